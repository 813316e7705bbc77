"""pled: keep a large model's embedding tables resident in sealed shared memory, served to every vLLM process."""

__version__ = "0.2.0"
