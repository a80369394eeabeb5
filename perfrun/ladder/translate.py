"""``perfrun report PATH --as hf|lightning|torch|perfrun``: the measured configuration as
Python for Hugging Face's ``Trainer``, for Lightning, for a plain PyTorch loop, or as the
``perfrun train`` line.

The rows of :mod:`perfrun.ladder.translations` say what each key becomes; this module lays
them into a script that runs as printed (the parts that need your model or data are
comments or functions that take them). Each argument is preceded by the perfrun key it
stands for and what perfrun measured that knob to buy; a knob the trainer has no form of is
named in a closing comment. Values reach the code through ``repr`` of values
:func:`perfrun.ladder.recorded.check` let through; comments are cut to one printable line.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from typing import Any

from perfrun.ladder.answer import Answer, answer, spelt
from perfrun.ladder.translations import ROWS, Arg, Expr, Missing
from perfrun.report.rows import Report, ReportError, Spoken
from perfrun.report.spoken import TRAINERS, where

NOT_MEASURED = ("no knob was measured on its own here: perfrun train -m +sweep=ablation, with your model and data, "
                "measures what each buys, and perfrun report SWEEP --as then says it beside each")
HONEST = ("perfrun measured these knobs in its own training loop with its own implementations; {whose}: "
          "expect each knob to act the same way, not the same figures")
WHOSE = {"hf": "Hugging Face's Trainer runs its own loop, with your model's own attention and checkpointing",
         "lightning": "Lightning runs its own loop around your LightningModule",
         "torch": "this loop is perfrun's in outline (autocast, accumulation, clipping, the step), not its code"}
INDENT = "    "
WIDTH = 100  # columns a comment is wrapped at


def comment(text: str) -> str:
    """Text from a record made safe for a ``#`` comment: one line of printable characters."""
    return "".join(ch if ch.isprintable() else " " for ch in str(text))


def _literal(value: Any) -> str:
    return str(value) if isinstance(value, Expr) else repr(value)


class _Parts:
    """The active forms of every row for one trainer, by where they go."""

    def __init__(self, trainer: str, a: Answer) -> None:
        self.args: dict[str, dict[str, tuple[Any, list[str]]]] = {}  # target -> name -> (value, comments)
        self.code: dict[str, list[list[str]]] = {}  # section -> blocks of lines
        self.missing: list[str] = []
        c = a.config
        for row in ROWS:
            shown = _shown(row.key, c)
            value = f"{row.key}={spelt(c.get(row.key) if shown is None else shown)}"
            measured = a.effects.get(row.key)
            said: set[str] = set()  # where this row's key and figure were said already
            for form in row.forms(trainer):
                if not form.when(c):
                    continue
                if isinstance(form, Missing):
                    if row.on(c):
                        self.missing.append(f"{value}: {form.why}" + (f". perfrun measured: {measured}" if measured else ""))
                    continue
                where = form.target if isinstance(form, Arg) else form.section
                notes = [value + (f": {measured}" if measured else "")] if (measured or row.on(c)) and where not in said else []
                said.add(where)
                if form.scope:
                    notes.append(f"not the same scope: {form.scope}")
                if isinstance(form, Arg):
                    args = self.args.setdefault(form.target, {})
                    if form.name not in args:
                        args[form.name] = (form.value(c), notes)
                else:
                    self.code.setdefault(form.section, []).append(_comments(notes, "") + form.lines(c))

    def call(self, target: str, indent: str = INDENT, fixed: dict[str, str] | None = None) -> list[str]:
        """The keyword arguments of ``target``, one a line, each under its comments."""
        out = [f"{indent}{k}={v}," for k, v in (fixed or {}).items()]
        for name, (value, notes) in self.args.get(target, {}).items():
            out += _comments(notes, indent)
            out.append(f"{indent}{name}={_literal(value)},")
        return out

    def section(self, name: str, indent: str = "", commented: bool = False) -> list[str]:
        """A section's lines; definitions (``def``) apart, after two blank lines, as PEP 8 has them."""
        blocks = self.code.get(name, [])
        plain = [ln for b in blocks if not _defines(b) for ln in b]
        defs = [ln for b in blocks if _defines(b) for ln in ["", "", *b]]
        defs += ["", ""] if defs else []
        return [f"{indent}{'# ' if commented and not ln.startswith('#') else ''}{ln}" if ln else ""
                for ln in [*plain, *defs]]

    def closing(self, where: str) -> list[str]:
        if not self.missing:
            return []
        return ["", f"# No equivalent in {where}:", *(ln for m in self.missing for ln in _comments([m], "", "- "))]


def _defines(block: list[str]) -> bool:
    return any(ln.startswith("def ") for ln in block)


def _comments(notes: list[str], indent: str, bullet: str = "") -> list[str]:
    """``notes`` as ``#`` lines of at most WIDTH columns, each note's continuation indented."""
    out = []
    for note in notes:
        lines = textwrap.wrap(comment(note), WIDTH - len(indent) - 2 - len(bullet)) or [""]
        out += [f"{indent}# {bullet if i == 0 else ' ' * len(bullet)}{ln}" for i, ln in enumerate(lines)]
    return out


def _shown(key: str, c: dict[str, Any]) -> Any:
    """The value a row stands for where its key is one setup resolved (the batch, the device)."""
    return {"dataloader.batch_size": c.get("batch_size"), "device": c.get("device_type"),
            "optim.fused": c.get("fused_adamw")}.get(key)


def _head(a: Answer, trainer: str, command: str) -> list[str]:
    notes = [f"{command}: the configuration of {a.source}"]
    if a.headline:
        notes.append(f"it ran at {a.headline}")
    if not a.effects:
        notes.append(NOT_MEASURED)
    notes.append(HONEST.format(whose=WHOSE[trainer]))
    return _comments(notes, "")


def to_hf(a: Answer, command: str) -> str:
    p = _Parts("hf", a)
    out = [*_head(a, "hf", command),
           "import functools", "", "import torch", "from transformers import AutoModelForCausalLM, TrainingArguments", ""]
    out += p.section("setup")
    out += ["model_kwargs = dict(", *p.call("from_pretrained"), ")",
            "# model = AutoModelForCausalLM.from_pretrained(YOUR_MODEL, **model_kwargs)"]
    out += p.section("model", commented=True)
    out += ["", "args = TrainingArguments(", *p.call("TrainingArguments"), ")",
            "# trainer = Trainer(model=model, args=args, train_dataset=YOUR_DATASET)"]
    train = p.section("train")
    out += [*train, "# with attention_kernel():", f"#{INDENT}trainer.train()"] if train else ["# trainer.train()"]
    return "\n".join([*out, *p.closing("TrainingArguments")]) + "\n"


def to_lightning(a: Answer, command: str) -> str:
    p = _Parts("lightning", a)
    out = [*_head(a, "lightning", command),
           "import functools", "import math", "", "import lightning", "import torch", "import torch.nn.functional as F",
           "from torch.utils.checkpoint import checkpoint", "from torch.utils.data import DataLoader", ""]
    out += p.section("setup") + p.section("module")
    out += ["", "trainer = lightning.Trainer(", *p.call("Trainer"), ")",
            "loader_kwargs = dict(", *p.call("DataLoader", fixed={"shuffle": "True", "drop_last": "True"}), ")",
            "# train_loader = DataLoader(YOUR_DATASET, **loader_kwargs)"]
    if "torch.compile" in p.args or "compile" in p.code:
        out += ["compile_kwargs = dict(", *p.call("torch.compile"), ")"]
    body = p.section("model", INDENT * 2) + p.section("compile", INDENT * 2)
    out += ["", "", "class PerfrunKnobs(lightning.LightningModule):",
            f'{INDENT}"""The knobs that live in a LightningModule: subclass it and keep your model in self.model."""', "",
            f"{INDENT}def configure_model(self):",
            f"{INDENT * 2}model = self.model", *body, f"{INDENT * 2}self.model = model", "",
            f"{INDENT}def configure_optimizers(self):",
            f"{INDENT * 2}params = [p for p in self.parameters() if p.requires_grad]",
            f"{INDENT * 2}groups = [{{'params': [p for p in params if p.dim() >= 2]}},  # decayed: matrices",
            f"{INDENT * 2}          {{'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}}]",
            f"{INDENT * 2}optimizer = torch.optim.AdamW(", f"{INDENT * 3}groups,", *p.call("AdamW", INDENT * 3),
            f"{INDENT * 2})",
            f"{INDENT * 2}scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)",
            f"{INDENT * 2}return {{'optimizer': optimizer, 'lr_scheduler': {{'scheduler': scheduler, 'interval': 'step'}}}}",
            "", "", "# trainer.fit(YourModule(), train_loader)  # YourModule subclasses PerfrunKnobs"]
    train = p.section("train")
    if train:
        out += [*train, "# with attention_kernel():", f"#{INDENT}trainer.fit(YourModule(), train_loader)"]
    return "\n".join([*out, *p.closing("Lightning")]) + "\n"


def to_torch(a: Answer, command: str) -> str:
    p = _Parts("torch", a)
    device = "cuda" if a.config.get("device_type") == "cuda" else "cpu"
    out = [*_head(a, "torch", command),
           "import contextlib", "import functools", "import math", "", "import torch", "import torch.nn.functional as F",
           "from torch.utils.checkpoint import checkpoint", "from torch.utils.data import DataLoader", "",
           f"DEVICE = torch.device({device!r})",
           f"MAX_STEPS = {int(a.config['max_steps'])!r}", *p.section("module"), "",
           "autocast_kwargs = dict(", *p.call("autocast", fixed={"device_type": "DEVICE.type"}), ")"]
    if "torch.compile" in p.args or "compile" in p.code:
        out += ["compile_kwargs = dict(", *p.call("torch.compile"), ")"]
    out += ["", "",
            "def setup(model, dataset):",
            f'{INDENT}"""Once, before the loop. model: forward(x, y) returns (logits, loss); dataset: (x, y) pairs."""',
            *p.section("setup", INDENT), f"{INDENT}model = model.to(DEVICE)", *p.section("model", INDENT),
            f"{INDENT}params = [p for p in model.parameters() if p.requires_grad]",
            f"{INDENT}groups = [{{'params': [p for p in params if p.dim() >= 2]}},  # decayed: matrices",
            f"{INDENT}          {{'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}}]",
            f"{INDENT}optimizer = torch.optim.AdamW(", f"{INDENT * 2}groups,", *p.call("AdamW", INDENT * 2), f"{INDENT})",
            f"{INDENT}scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)",
            f"{INDENT}scaler = torch.amp.GradScaler(", *p.call("GradScaler", INDENT * 2, fixed={"device": "DEVICE.type"}),
            f"{INDENT})",
            *p.section("compile", INDENT),
            f"{INDENT}loader = DataLoader(",
            *p.call("DataLoader", INDENT * 2, fixed={"dataset": "dataset", "shuffle": "True", "drop_last": "True"}),
            f"{INDENT})",
            f"{INDENT}return model, optimizer, scheduler, scaler, loader",
            "", "",
            "def train(model, optimizer, scheduler, scaler, loader, steps=MAX_STEPS):",
            f'{INDENT}"""The loop: accumulated micro-batches under autocast, (scaled) backward, clip, step."""',
            f"{INDENT}batches = iter(loader)",
            f"{INDENT}for _ in range(steps):",
            f"{INDENT * 2}for _ in range(accumulation):",
            f"{INDENT * 3}x, y = next(batches, (None, None))",
            f"{INDENT * 3}if x is None:  # a new epoch",
            f"{INDENT * 4}batches = iter(loader)",
            f"{INDENT * 4}x, y = next(batches)",
            f"{INDENT * 3}x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)",
            f"{INDENT * 3}with torch.autocast(**autocast_kwargs), attention_kernel():",
            f"{INDENT * 4}_, loss = model(x, y)",
            f"{INDENT * 3}scaler.scale(loss / accumulation).backward()",
            f"{INDENT * 2}scaler.unscale_(optimizer)",
            f"{INDENT * 2}if clip:",
            f"{INDENT * 3}torch.nn.utils.clip_grad_norm_(model.parameters(), clip)",
            f"{INDENT * 2}scaler.step(optimizer)",
            f"{INDENT * 2}scaler.update()",
            f"{INDENT * 2}optimizer.zero_grad(set_to_none=True)",
            f"{INDENT * 2}scheduler.step()",
            "", "",
            "# model, optimizer, scheduler, scaler, loader = setup(YOUR_MODEL, YOUR_DATASET)",
            "# train(model, optimizer, scheduler, scaler, loader)"]
    return "\n".join([*out, *p.closing("this loop")]) + "\n"


def to_perfrun(a: Answer, command: str) -> str:
    notes = [f"{command}: the configuration of {a.source}"] + ([f"it ran at {a.headline}"] if a.headline else [])
    return "\n".join([*_comments(notes, ""), a.line]) + "\n"


RENDER: dict[str, Callable[[Answer, str], str]] = {"hf": to_hf, "lightning": to_lightning, "torch": to_torch,
                                                  "perfrun": to_perfrun}


def translate(a: Answer, trainer: str, command: str) -> str:
    """The answer in ``trainer``'s words (one of AS_CHOICES); ``command`` heads it."""
    return re.sub(r"\n{4,}", "\n\n\n", RENDER[trainer](a, command))  # at most two blank lines, as PEP 8 has them


def arguments(a: Answer, trainer: str) -> dict[str, dict[str, Any]]:
    """The keyword arguments the translation passes, by target (TrainingArguments, Trainer,
    AdamW, ...): what the tests build the real objects from."""
    return {target: {name: value for name, (value, _) in args.items()}
            for target, args in _Parts(trainer, a).args.items()}


def spoken(report: Report) -> list[Spoken]:
    """What the HTML report shows: each ladder's verdict, or the single run, as code for each
    trainer (the answer() of ``perfrun report DIR --as``)."""
    targets: list[tuple[str, dict[str, Any] | None]] = [(a["root"] or where(report), a) for a in report.ladders]
    if not report.ladders and len(report.rows) == 1:
        targets = [(where(report), None)]
    out = []
    for given, ladder in targets:
        try:
            a = answer(report, given, None, ladder)
        except ReportError as e:
            out.append(Spoken(given, {}, str(e)))
            continue
        out.append(Spoken(a.source, {t: translate(a, t, f"perfrun report {given} --as {t}") for t in TRAINERS}))
    return out

