import pytest

from pled.daemon import config
from pled.shared.errors import EX_CONFIG, ConfigError


def parse(text):
    return config.parse(text, "/etc/pled/pled.toml")


def test_defaults_and_sizes():
    c = parse('headroom_margin = "1.5GiB"\n[[table]]\nname = "ples_int4"\npath = "/srv/ples"\n')
    assert c.socket == "/run/pled/pled.sock"
    assert c.huge_pages == "auto"
    assert c.headroom_margin == 3 * 1024**3 // 2
    assert c.tables[0].name == "ples_int4" and c.tables[0].path == "/srv/ples"
    assert parse("headroom_margin = 4096").headroom_margin == 4096


def test_relative_table_path_is_taken_from_the_config_directory(tmp_path):
    f = tmp_path / "pled.toml"
    f.write_text('[[table]]\nname = "t"\npath = "sidecar"\n')
    assert config.load(str(f)).tables[0].path == str(tmp_path / "sidecar")


@pytest.mark.parametrize(
    "text, key, words",
    [
        ("sokcet = '/run/x'", "sokcet", "unknown key"),
        ("huge_pages = 'yes'", "huge_pages", "'prefer-hugetlb', 'hugetlb' or 'off'"),
        ("huge_page_size = '2 MB'", "huge_page_size", "is not a page size; write it as \"2M\" or \"1G\""),
        ("numa = 'everywhere'", "numa", "\"interleave\", \"local\" or a list of node numbers"),
        ("numa = []", "numa", "an empty list of nodes"),
        ("[[table]]\nname = 'a'\npath = '/x'\nhuge_pages = 'on'", "table[0].huge_pages", "'hugetlb' or 'off'"),
        ("[[table]]\nname = 'a'\npath = '/x'\nnuma = [1, 1]", "table[0].numa", "distinct NUMA node numbers"),
        ("headroom_margin = 'lots'", "headroom_margin", "not a size"),
        ("headroom_margin = -1", "headroom_margin", "negative"),
        ("socket = 'relative.sock'", "socket", "absolute"),
        ("socket = '/run/" + "x" * 120 + "'", "socket", "at most 107"),
        ("[[table]]\nname = 'a b'\npath = '/x'", "table[0].name", "table name"),
        ("[[table]]\nname = 'a'", "table[0]", "give either path"),
        ("[[table]]\nname = 'a'\npath = 'x'\ncheckpoint = 'y'", "table[0]", ": not both"),
        ("[[table]]\nname = 'a'\npath = '/x'\ncolour = 1", "table[0].colour", "unknown key"),
        ("[[table]]\nname = 'a'\npath = '/x'\n[[table]]\nname = 'a'\npath = '/y'", "table", "used twice"),
    ],
)
def test_bad_values_name_the_key_and_the_file(text, key, words):
    with pytest.raises(ConfigError) as err:
        parse(text)
    msg = str(err.value)
    assert msg.startswith("/etc/pled/pled.toml: ")
    assert f"key {key}:" in msg
    assert words in msg
    assert err.value.exit_status == EX_CONFIG


def test_toml_syntax_error_names_the_file():
    with pytest.raises(ConfigError, match=r"^/etc/pled/pled.toml: not valid TOML"):
        parse("socket = ")


def test_missing_file_and_env_override(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="no such file"):
        config.load(str(tmp_path / "absent.toml"))
    f = tmp_path / "env.toml"
    f.write_text("huge_pages = 'off'\n")
    monkeypatch.setenv("PLED_CONFIG", str(f))
    assert config.load(None).huge_pages == "off"
    assert config.load(None).source == str(f)
    monkeypatch.delenv("PLED_CONFIG")
    assert config.resolve_path(None) == "/etc/pled/pled.toml"


def test_example_config_is_valid_with_and_without_its_table(tmp_path):
    """config/pled.toml, which the Debian package installs as /etc/pled/pled.toml, sets no table (one that is not
    on the host would make pled exit 78 at every boot); the commented [[table]] it shows is valid once uncommented."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "config" / "pled.toml").read_text()
    example = tmp_path / "pled.toml"
    example.write_text(text)
    assert config.load(str(example)).tables == ()
    uncommented = text.replace("#[[table]]\n#name", "[[table]]\nname").replace("\n#path", "\npath", 1)
    assert uncommented.count("\n[[table]]\n") == 1
    example.write_text(uncommented)
    tables = config.load(str(example)).tables
    assert [(t.name, t.path) for t in tables] == [("ples_int4", "/srv/models/gemma/ples_int4")]
