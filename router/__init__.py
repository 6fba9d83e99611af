"""llmgw's data plane: an OpenAI-compatible router that sends traffic straight to the engines.

It depends on ``schema`` only (never on ``control`` or ``agent``), so it runs as its own service
(``python -m router``, several of them in production) or embedded in the control plane."""
