"""The llmgw node agent: discovery, engine supervision, and the stream to the control plane."""

__version__ = "0.1.0"
