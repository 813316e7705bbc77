"""pled's start-up hook, imported by ``pled-autoload.pth`` in every interpreter of the environment pled is
installed in, where ``PLED_SOCKET`` is set (or vLLM's ``VLLM_PLUGINS`` leaves pled out: then only to say, once per
process that loads a table, that pled is off there) and ``PLED_AUTOLOAD`` is not ``0``.

It installs the import hook the vLLM plugin installs (pled.client.vllm_plugin.register), so a process that never
loads vLLM's plugins (the PLE offload worker, started with multiprocessing's spawn) also reads the files
pled holds from shared memory through ``safetensors.safe_open``. It imports nothing else: no torch, no
vLLM, no socket is opened until a file is asked for. Whatever goes wrong here is one line on stderr; the
interpreter always starts.
"""
import os
import sys


def _left_out_by_vllm() -> bool:
    """``VLLM_PLUGINS`` set without ``pled`` (vLLM's rule, pled.client.held_files.left_out_by_vllm): vLLM will not
    register pled even where ``--additional-config`` enables it, so the hook is installed here to say so."""
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is not None and "pled" not in allowed.split(",")


def run() -> None:
    if os.environ.get("PLED_AUTOLOAD", "1") == "0":
        return
    if not os.environ.get("PLED_SOCKET") and not _left_out_by_vllm():
        return
    try:
        from pled.client import vllm_plugin

        vllm_plugin.register()
    except Exception as err:  # never stop an interpreter from starting
        sys.stderr.write(f"pled: start-up hook failed ({type(err).__name__}: {err}); this process reads tables "
                         "from disk; set PLED_AUTOLOAD=0 to silence this\n")


run()
