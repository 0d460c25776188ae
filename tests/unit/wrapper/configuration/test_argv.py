"""Reading and editing llama-server command lines."""

from __future__ import annotations

from wrapper.configuration import argv as args


def test_argv_helpers() -> None:
    argv = ["s", "--port=1", "-c", "10", "--host", "h", "-kvu", "-no-kvu"]
    assert args.get(argv, args.PORT) == "1" and args.get(argv, args.CTX_SIZE) == "10"
    assert args.remove(args.remove(argv, args.HOST), args.PORT) == ["s", "-c", "10", "-kvu", "-no-kvu"]
    assert args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED) is False
    assert args.replace(argv, args.CTX_SIZE, "20")[-2:] == ["--ctx-size", "20"]
