"""Real engines for the end-to-end test and the demo, built from the package registries alone.

The ``sim`` engine proves our side of the contract; only a real engine proves that an adapter drives
one. This package builds llama.cpp's ``llama-server`` from the llama-cpp-python sdist (which vendors
llama.cpp's whole source) and writes a tiny llama model with random weights next to it, both into a
cache outside the checkout (``$XDG_CACHE_HOME/llmgw/llama.cpp/<version>/``, default ``~/.cache``):
the build takes about 15 minutes on two cores, and a checkout is the wrong place for 300 MB of
objects that every worktree and every CI run can share.

``python -m enginebuild`` (what ``nox -s engines`` runs) builds what is missing and prints the paths;
``enginebuild.llamacpp.installed()`` is how a test or the demo finds them without building.
"""
