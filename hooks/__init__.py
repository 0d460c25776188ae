"""The built-ins: what the wrapper does beyond supervising and proxying, a package per concern, each declared once
in hooks/registry.py (the wrapper reads that table through wrapper/built_ins.py only). The layers between them
are declared in pyproject.toml and checked by `make lint`; docs/layout.md has the glossary."""
