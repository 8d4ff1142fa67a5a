"""What a run reads before it plans: the model of every role (and the
policy's tokenizer) and the prompt data."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from flowc.errors import DataError, SpecError
from flowc.ir.graph import FlowGraph
from flowc.ir.models import ModelSpec
from flowc.ir.ops import RoleKind
from flowc.runtime.data import Records


# ------------------------------------------------------------------- models
def materialize_model(ref: str, out_dir: Path, tokenizer_dir: str) -> str:
    """An HF directory for ``ref``: a directory as given; the built-in model for
    ``flowc-tiny``; a catalogue name or config.json → a randomly initialised
    model written once under the run directory."""
    from flowc.tasks.arithmetic import asset_dir

    p = Path(ref)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise SpecError(f"model directory {ref} has no config.json", fix="give an HF model directory")
        return str(p)
    if ref in ("flowc-tiny", "tiny"):
        return str(asset_dir())
    spec = ModelSpec.resolve(ref)
    target = out_dir / "models" / spec.name.replace("/", "_")
    if not (target / "config.json").exists():
        from transformers import AutoTokenizer

        from flowc.runtime.modeling import load_causal_lm

        model = load_causal_lm(spec)
        model.save_pretrained(target, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
    return str(target)


def check_tokenizer(tokenizer: str, sources: dict[str, str]) -> None:
    """The policy's tokenizer must load, have EOS and PAD, and fit every model's vocabulary."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((Path(tokenizer) / f).exists() for f in files):
        raise SpecError(
            f"{tokenizer} has no tokenizer files ({', '.join(files)})",
            fix="save the model's tokenizer in its directory (tokenizer.save_pretrained)",
        )
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:
        raise SpecError(
            f"cannot load a tokenizer from {tokenizer}: {type(e).__name__}: {e}",
            fix="the policy's directory must hold its tokenizer files",
        ) from e
    if tok.eos_token_id is None or tok.pad_token_id is None:
        raise SpecError(
            f"the tokenizer in {tokenizer} has no EOS or PAD token",
            fix="set eos_token and pad_token in its tokenizer_config.json",
        )
    for role, src in sources.items():
        vocab = json.loads((Path(src) / "config.json").read_text()).get("vocab_size")
        if vocab is not None and len(tok) > vocab:
            raise SpecError(
                f"the tokenizer in {tokenizer} has {len(tok)} tokens but {role}'s model ({src}) has a vocabulary of {vocab}",
                fix="use the tokenizer that was trained with this model",
            )


def check_model_roles(g: FlowGraph, given: dict[str, str]) -> None:
    """``--model ROLE=…`` names model roles of ``g``, and gives the policy's model when it gives any."""
    for role in given:
        if role not in g.roles:
            close = difflib.get_close_matches(role, list(g.roles), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpecError(
                f"--model names role {role!r}, which flow {g.name!r} does not have{hint}", fix=f"its roles: {', '.join(g.roles)}"
            )
        if g.roles[role].kind == RoleKind.REWARD:
            raise SpecError(
                f"role {role!r} is a Python reward function, not a model", fix=f"bind it with --reward {role}=module:function"
            )
    policies = [r for r, i in g.roles.items() if i.kind == RoleKind.POLICY]
    if given and policies and not any(p in given for p in policies):
        raise SpecError(f"no model given for policy role {policies[0]!r}", fix=f"pass --model {policies[0]}=NAME")


def model_sources(g: FlowGraph, given: dict[str, str], out: Path) -> tuple[dict[str, str], str]:
    """An HF directory for every model role (a role not given uses the policy's model,
    and with none given the built-in tiny model), and the policy's tokenizer directory."""
    from flowc.tasks.arithmetic import asset_dir

    check_model_roles(g, given)
    policy = next((r for r, i in g.roles.items() if i.kind == RoleKind.POLICY), None)
    base = given.get(policy) if policy else None
    tok_dir = str(asset_dir())
    sources: dict[str, str] = {}
    for role, info in g.roles.items():
        if info.kind != RoleKind.REWARD:
            sources[role] = materialize_model(given.get(role) or base or "flowc-tiny", out, tok_dir)
    tokenizer = sources[policy] if policy else tok_dir
    check_tokenizer(tokenizer, sources)
    return sources, tokenizer


# --------------------------------------------------------------------- data
def load_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a JSONL or Parquet file."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path} does not exist")
    if p.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not a JSON object: {e}") from e
        return rows
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    raise DataError(f"data file {path} is neither .jsonl nor .parquet")


def load_data(g: FlowGraph, data: str | None, eval_data: str | None) -> tuple[Records, Records | None]:
    """The training and held-out records: the user's files, or the built-in task's
    (prompts, or preference pairs when the flow reads ``fc.Preferences``)."""
    from flowc.tasks import arithmetic as arith

    preferences = any(n.op == "input" and n.kwargs.get("kind") == "preferences" for n in g.nodes)
    if data is None:
        train_p, eval_p = arith.split()
        rows_of = arith.preference_records if preferences else arith.records
        return Records(rows_of(train_p), "built-in arithmetic"), Records(rows_of(eval_p), "built-in arithmetic (held out)")
    train = Records(load_rows(data), data)
    held = Records(load_rows(eval_data), eval_data) if eval_data else None
    if preferences:
        for d in (train, held):
            missing = [c for c in ("chosen", "rejected") if d is not None and c not in d.rows[0]]
            if missing:
                raise DataError(
                    f"{d.name} has no {' or '.join(repr(c) for c in missing)} column, which preference pairs need "
                    f"(columns: {', '.join(d.rows[0])})",
                    fix="give each row a prompt, a chosen and a rejected response",
                )
    return train, held
