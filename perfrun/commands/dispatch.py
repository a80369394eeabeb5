"""``perfrun COMMAND ...``: the usage, shell completion, and each command's ``main``,
imported only when that command runs (so ``perfrun --help`` and a Tab import no torch).

Hydra's completion script calls ``perfrun -sc query=bash`` with the whole line in
COMP_LINE; the ``train`` word is removed from it here, since Hydra knows no subcommands,
and the answer is composed without importing the trainer (no torch), so a Tab is quick.
"""

from __future__ import annotations

import os
import sys

from perfrun.console import error

COMMANDS = {
    "train": "train a GPT with the knobs you choose (a Hydra app: perfrun train --help)",
    "gpu-check": "diagnose this machine and measure what it can do",
    "report": "the table and plot of runs or sweeps, after the fact (perfrun report PATH...)",
    "estimate": "the memory a configuration will need, by category and module, before it runs (a Hydra app)",
    "tune": "search batch size, checkpointing, compile and workers for the highest tokens/s",
    "generate": "sample text from a checkpoint with a KV cache, and measure what the cache buys",
    "export": "write a checkpoint as ONNX or safetensors (in the Hugging Face GPT-2 or Llama layout)",
    "prepare": "tokenise a corpus into train.bin/val.bin for data=memmap (a Hydra app: perfrun prepare --help)",
}
# The other commands: each module's main(argv) -> exit code, imported only when used.
_MODULES = {name: f"perfrun.commands.{name.replace('-', '_')}" for name in COMMANDS}
# the other commands that are Hydra apps: Tab completes their keys as it does train's
HYDRA_COMMANDS = ("tune", "estimate", "generate", "export", "prepare")


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: perfrun COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    lines += [
        "",
        "options:",
        "  -h, --help  this list",
        "  --version   print perfrun's version",
        "",
        "examples:",
        "  perfrun train                                  # the built-in default: tiny GPT on Python's own source",
        "  perfrun train precision=bf16 compile=true",
        "  perfrun train -m dataloader.batch_size=8,16,32 dataloader.num_workers=0,2,4",
        "  perfrun train --json max_steps=50 > summary.json  # the summary on stdout, the log on stderr",
        "  perfrun gpu-check",
        "",
        "shell completion:  eval \"$(perfrun train -sc install=bash)\"",
    ]
    return "\n".join(lines)


def _complete_subcommand() -> int | None:
    """Shell completion: strip the subcommand from COMP_LINE, or complete the subcommand."""
    line = os.environ.get("COMP_LINE", "")
    words = line.split()
    if len(words) >= 2 and words[1] in ("train", *HYDRA_COMMANDS) and (len(words) > 2 or line.endswith(" ")):
        os.environ["COMP_LINE"] = line.replace(f" {words[1]}", "", 1)
        if words[1] == "train":
            return None
        import importlib

        return importlib.import_module(_MODULES[words[1]]).main(["-sc", "query=bash"])
    prefix = words[1] if len(words) >= 2 and not line.endswith(" ") else ""
    print(" ".join(c for c in COMMANDS if c.startswith(prefix)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from perfrun import __version__

        print(f"perfrun {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("-sc", "--shell-completion"):
        if any(a.startswith("query=") for a in rest):
            done = _complete_subcommand()
            if done is not None:
                return done
        from perfrun.commands.train import shell_completion

        return shell_completion(argv)
    if command in _MODULES:
        import importlib

        return importlib.import_module(_MODULES[command]).main(rest)
    error(f"unknown command {command!r}; the commands are {', '.join(COMMANDS)} (perfrun --help)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
