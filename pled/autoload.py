"""pled's start-up hook, imported by ``pled-autoload.pth`` in every interpreter of the environment pled is
installed in, where ``PLED_SOCKET`` is set and ``PLED_AUTOLOAD`` is not ``0``.

It installs the import hook the vLLM plugin installs (pled.client.vllm_plugin.register), so a process that never
loads vLLM's plugins (the PLE offload worker, started with multiprocessing's spawn) also reads the files
pled holds from shared memory through ``safetensors.safe_open``. It imports nothing else: no torch, no
vLLM, no socket is opened until a file is asked for. Whatever goes wrong here is one line on stderr; the
interpreter always starts.
"""
import os
import sys


def run() -> None:
    if not os.environ.get("PLED_SOCKET") or os.environ.get("PLED_AUTOLOAD", "1") == "0":
        return
    try:
        from pled.client import vllm_plugin

        vllm_plugin.register()
    except Exception as err:  # never stop an interpreter from starting
        sys.stderr.write(f"pled: start-up hook failed ({type(err).__name__}: {err}); this process reads tables "
                         "from disk; set PLED_AUTOLOAD=0 to silence this\n")


run()
