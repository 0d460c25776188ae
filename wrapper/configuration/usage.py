"""How the wrapper is run, shown by `llama-wrapper --help` and `llama-wrapper run --help`, and the strict parsing of
the options that come before `--`."""

from __future__ import annotations

import click

RUN_EXAMPLES = """
\b
Examples:
  llama-wrapper run -- llama-server -m model.gguf -c 8192
  llama-wrapper run --config hooks.yaml --listen 127.0.0.1:8080 -- llama-server -m model.gguf
  llama-wrapper check hooks.yaml
\b
As a llama-swap model:
  cmd: llama-wrapper run --listen 127.0.0.1:${PORT} --config chat.yaml -- llama-server -m chat.gguf
"""


class ServerCommand(click.Command):
    """`run` and `plan`: their own options, then `--` and the llama-server command. An unknown option before it is
    an error with a suggestion (not the server command), and no option takes a word that starts with `-` as its
    value: `--slots-dir -- llama-server …` is a forgotten value, not a folder named `--`. Use it with
    `context_settings=SERVER_COMMAND_SETTINGS`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        valued = {name for p in self.params if isinstance(p, click.Option) and not p.is_flag and not p.count
                  for name in p.opts}
        at = 0
        while at < len(args) and args[at] != "--" and args[at].startswith("-"):
            word = args[at]
            if word in valued:
                following = args[at + 1] if at + 1 < len(args) else None
                if following is None or following.startswith("-"):
                    shown = "nothing" if following is None else repr(following)
                    raise click.UsageError(f"{word} needs a value, but the next word is {shown}: write {word} "
                                           "VALUE before the `--` that starts the llama-server command", ctx)
                at += 1
            at += 1  # stops at the first word of the llama-server command, or at `--`
        return super().parse_args(ctx, args)


SERVER_COMMAND_SETTINGS = {"allow_interspersed_args": False}  # after the first word of the server command, all is its
