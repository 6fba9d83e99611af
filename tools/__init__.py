"""Development tools (not installed for users): ``python -m tools.protogen`` regenerates schema/gen."""
