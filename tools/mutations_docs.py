"""Breakages that the docs' tests must catch (tests/test_docs.py, tests/test_deb_version.py; issue 47, items 4 and 6
and their siblings): a documented example that no longer runs, a block without its marker, a command or option or
make target or link the docs name that does not exist, a --help line without its default, the README's table of
commands missing an option, and a package version built other than docs/operations.md says (tools/mutations.py's
format and runner).

    python tools/mutations_docs.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_docs.py --list     # and its other options (-k, --timeout)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

T = "tests/test_docs.py::"
RUN = T + "test_a_run_block_runs"
MARKED = T + "test_every_block_in_the_docs_says_whether_it_runs_and_why_not"
NAMED = T + "test_every_pled_command_and_option_the_docs_name_exists"
HELP = T + "test_every_commands_help_names_each_option_and_its_default"
TABLE = T + "test_the_readmes_table_of_commands_lists_every_command_and_each_of_its_options"
LINKS = T + "test_every_link_between_the_docs_leads_to_a_file_and_a_heading_that_exist"
MAKE = T + "test_every_make_target_and_variable_the_docs_name_is_in_the_makefile"
FILES = T + "test_every_file_of_the_checkout_the_docs_name_exists"
CONFIG = T + "test_a_config_block_is_a_config_pled_accepts"
V = "tests/test_deb_version.py::"

MUTATIONS = [
    # The examples that run.
    Mutation("operations.md's Python example without its import of torch (issue 47.4 as seen)", "docs/operations.md",
             "import torch\n\nfrom pled.client import attach\n", "from pled.client import attach\n", (RUN,)),
    Mutation("operations.md's Python example pins its output where no CUDA is (issue 47.4 as seen)",
             "docs/operations.md", "pin_memory=torch.cuda.is_available())", "pin_memory=True)", (RUN,)),
    Mutation("operations.md's Python example gathers row ids it never made (issue 47.4 as seen)", "docs/operations.md",
             "    row_ids = torch.randint(0, rows, (4096,))", "    rows = torch.randint(0, rows, (4096,))", (RUN,)),
    Mutation("protocol.md's socat example at the host's socket whatever PLED_SOCKET says", "docs/protocol.md",
             'UNIX-CONNECT:"${PLED_SOCKET:-/run/pled/pled.sock}"', "UNIX-CONNECT:/run/pled/pled.sock", (RUN,)),
    Mutation("the version a VERSION build carries shown with head (pipefail: SIGPIPE)", "docs/operations.md",
             'tools/deb.sh --changelog "$v" | sed -n 1,3p', 'tools/deb.sh --changelog "$v" | head -1', (RUN,)),
    Mutation("operations.md's checkpoint table example with a key pled refuses", "docs/operations.md",
             'checkpoint = "/srv/models/qwen4"\n```',
             'checkpoints = "/srv/models/qwen4"\n```', (CONFIG,)),
    # Every block says what it is.
    Mutation("a figure's block without its marker", "docs/ARCHITECTURE.md", "```text figure\nDaemon.run",
             "```\nDaemon.run", (MARKED,)),
    Mutation("a skipped block whose reason says nothing", "docs/operations.md",
             "```sh skip: needs a Kubernetes cluster; tests/test_deploy.py builds and validates the manifests offline",
             "```sh skip: n/a", (MARKED,)),
    # What the docs name exists.
    Mutation("the docs name an option pled status does not have", "docs/operations.md",
             "*liveness* (`pled status --live`)", "*liveness* (`pled status --alive`)", (NAMED,)),
    Mutation("the docs name a command pled does not have", "docs/operations.md",
             "runuser -u pled -- pled preflight  ", "runuser -u pled -- pled preflite  ", (NAMED,)),
    Mutation("a link to a heading that is not there", "README.md",
             "(docs/operations.md#vllm-033s-own-ple-path)", "(docs/operations.md#vllm-033-own-ple-path)", (LINKS,)),
    Mutation("a make target the Makefile does not have", "README.md", "make test-fast  #", "make test-quick #",
             (MAKE,)),
    Mutation("a file of the checkout the docs name that is not there", "docs/operations.md",
             "install -m 644 units/pled.service /etc/systemd/system/",
             "install -m 644 units/pled.unit /etc/systemd/system/", (FILES,)),
    Mutation("a Kubernetes probe runs a pled option that does not exist", "deploy/kubernetes/base/pled-daemonset.yaml",
             '"pled", "status", "--live"', '"pled", "status", "--alive"',
             (T + "test_every_pled_command_the_units_and_recipes_run_exists",)),
    Mutation("pled.service reloads with a command pled does not have", "units/pled.service",
             "ExecReload=/usr/lib/pled/bin/pled reload", "ExecReload=/usr/lib/pled/bin/pled restage",
             (T + "test_every_pled_command_the_units_and_recipes_run_exists",)),
    # --help and the README's table of commands.
    Mutation("pled status --timeout's help without its default", "pled/cli.py",
             "help=\"seconds to wait for pled's answer before exit 3 (default %(default)s)\")",
             "help=\"seconds to wait for pled's answer before exit 3\")", (HELP,)),
    Mutation("pled demo --rows without a help line", "pled/makers.py",
             'default=50_000, help="rows per shard (default %(default)s)")', "default=50_000)", (HELP,)),
    Mutation("README's row of pled reload without --timeout (as before issue 47)", "README.md",
             "| `pled reload [--timeout SECONDS] [--socket S \\| -c CONFIG]` |",
             "| `pled reload [--socket S \\| -c CONFIG]` |", (TABLE,)),
    # What pled's messages, its config and its catalog point to.
    Mutation("a refusal that names the checkout's docs/ instead of the installed docs (issue 47.7's class)",
             "pled/daemon/config.py", 'f"{DOCS}/operations.md, \\"The writable route\\", first)',
             'f"docs/operations.md, \\"The writable route\\", first)',
             (T + "test_pleds_messages_name_the_installed_docs_never_a_checkout_path",)),
    Mutation("the example config sends the operator to a section operations.md does not have", "config/pled.toml",
             'Also per [[table]]: operations.md, "Huge pages".',
             'Also per [[table]]: operations.md, "Huge page sizes".',
             (T + "test_every_section_of_operations_md_that_pled_or_its_files_name_exists",)),
    Mutation("the section that pled's writable-key refusal names is gone", "docs/operations.md",
             "#### The writable route\n", "#### Writable tables\n",
             (T + "test_every_section_of_operations_md_that_pled_or_its_files_name_exists",)),
    Mutation("a config key without its row in operations.md's Configuration", "docs/operations.md",
             "| `[[table]]` `gpu_routes` |", "| `[[table]]` `gpu_route_order` |",
             (T + "test_the_configuration_table_lists_every_key_pled_reads",)),
    Mutation("the docs name a variable pled never reads", "docs/operations.md",
             "`PLED_AUTOLOAD=0`, `VLLM_PLE_QUANT_DIR`", "`PLED_AUTOLOADS=0`, `VLLM_PLE_QUANT_DIR`",
             (T + "test_every_pled_variable_the_docs_name_is_read_or_written_somewhere",)),
    Mutation("README's exit statuses without gpu-check's 4", "README.md", "| 4 | `gpu-check`: no CUDA device",
             "| 5 | `gpu-check`: no CUDA device",
             (T + "test_the_readmes_exit_table_has_a_row_for_every_status_pled_defines",)),
    # A higher package version (issue 47.6).
    Mutation("a VERSION build without its changelog entry", "tools/deb.sh",
             "  if [ -n \"$version\" ]; then\n    printf 'pled (%s) bookworm",
             "  if false; then\n    printf 'pled (%s) bookworm",
             (V + "test_the_docs_higher_version_is_what_a_version_build_carries",)),
    Mutation("a VERSION below the changelog's taken", "tools/deb.sh",
             'if ! dpkg --compare-versions "$version" gt "$debian_version"; then',
             'if ! dpkg --compare-versions "$version" ge "0"; then',
             (V + "test_a_version_apt_would_not_take_as_an_upgrade_is_refused_in_one_line_with_64",)),
    Mutation("a VERSION with a Debian revision taken for a native package", "tools/deb.sh",
             'if [ "$version" != "${version%-*}" ]; then', "if false; then",
             (V + "test_a_version_apt_would_not_take_as_an_upgrade_is_refused_in_one_line_with_64",)),
    Mutation("a changelog that disagrees with pled.__version__ built anyway", "tools/deb.sh",
             'if [ "$upstream" != "$python_version" ]; then', "if false; then",
             (V + "test_a_changelog_that_disagrees_with_pled_version_is_refused_with_78",)),
    Mutation("make deb without its VERSION", "Makefile", "tools/deb.sh build/deb $(VERSION)", "tools/deb.sh build/deb",
             (V + "test_make_deb_hands_its_version_to_tools_deb_sh",)),
]



if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
