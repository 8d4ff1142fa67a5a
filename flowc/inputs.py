"""What a run reads before it plans: the model of every role (and the
policy's tokenizer) and the prompt data."""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowc.errors import DataError, SpecError
from flowc.ir.graph import FlowGraph
from flowc.ir.models import ModelSpec
from flowc.ir.ops import PYTHON_KINDS, RoleKind
from flowc.runtime.data import Records

# ------------------------------------------------------------------- models
BUILTIN_MODELS = ("flowc-tiny", "tiny", "flowc-calc-tiny")  # the arithmetic task's model, the calculator task's


def materialize_model(ref: str, out_dir: Path, *, init: str = "pretrained", scores: bool = False) -> tuple[str, str | None]:
    """An HF directory for ``ref``, and a line to tell the user (or None).

    A directory is used as it is; ``flowc-tiny`` is the built-in model (``scores``: the built-in
    reward model); a Hugging Face hub id is its cached snapshot (downloaded when the network
    allows). A catalogue name holds an architecture for planning, not weights: it runs only with
    ``init="random"``, which writes a randomly initialised model of that architecture once under
    the run directory (as it does for a directory or hub id given with ``init="random"``)."""
    from flowc.ir.hub import cached_snapshot, is_hub_id, snapshot
    from flowc.ir.models import catalogue, catalogue_key
    from flowc.tasks.builtin import builtin_model_dir

    p = Path(ref).expanduser()
    if ref in BUILTIN_MODELS and init == "pretrained":
        return str(builtin_model_dir(ref, scores=scores)), None
    if ref == "flowc-calc-tiny":  # random weights of its architecture, with its tokenizer
        local: Path | None = builtin_model_dir(ref)
    elif ref in BUILTIN_MODELS:
        local = None  # random weights of the catalogue's flowc-tiny
        ref = "flowc-tiny"
    elif p.is_dir():
        if not (p / "config.json").exists():
            raise SpecError(f"model directory {ref} has no config.json", fix="give an HF model directory")
        local = p
    elif is_hub_id(ref) and init == "pretrained":
        local = snapshot(ref)
    elif is_hub_id(ref):  # random weights: the cached config, else the catalogue's, else downloaded
        local = cached_snapshot(ref) or (None if catalogue_key(ref) in catalogue() else snapshot(ref))
    else:
        local = None
    if init == "pretrained":
        if local is not None:
            return str(local), None
        spec = ModelSpec.resolve(ref)  # an unknown name is refused here, with the catalogue listed
        what = "a config file" if p.is_file() else "a catalogue name"
        raise SpecError(
            f"{ref!r} is {what}: it holds {spec.name}'s architecture for planning, not its weights",
            fix="give a local model directory or a Hugging Face hub id (e.g. --model actor=Qwen/Qwen2.5-0.5B), "
            "or pass --init random to train it from random weights",
        )
    return _random_model(ref, local, out_dir, scores=scores)


def _random_model(ref: str, local: Path | None, out_dir: Path, *, scores: bool) -> tuple[str, str]:
    """A randomly initialised model of ``ref``'s architecture, written under the run directory
    with its tokenizer (the model's own, or the built-in one for a catalogue name)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from flowc.tasks.arithmetic import asset_dir

    name = ref.replace("/", "_")
    target = out_dir / "models" / (f"{name}-random" + ("-rm" if scores else ""))
    tok_dir = str(local) if local is not None else str(asset_dir())
    if not (target / "config.json").exists():
        import torch

        torch.manual_seed(0)
        if local is not None:
            cfg = AutoConfig.from_pretrained(str(local))
        else:
            from flowc.runtime.modeling import hf_config

            cfg = hf_config(ModelSpec.resolve(ref))
        if scores:
            cfg.num_labels = 1
            cfg.pad_token_id = AutoTokenizer.from_pretrained(tok_dir).pad_token_id
            model = AutoModelForSequenceClassification.from_config(cfg)
        else:
            model = AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(target, safe_serialization=True)
        AutoTokenizer.from_pretrained(tok_dir).save_pretrained(target)
    tok_note = "its own tokenizer" if local is not None else "the built-in arithmetic tokenizer (17 tokens)"
    return str(target), f"{ref}: random weights (--init random), with {tok_note}, written to {target}"


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


def model_sources(
    g: FlowGraph, given: dict[str, str], out: Path, *, init: str = "pretrained"
) -> tuple[dict[str, str], str, list[str]]:
    """An HF directory for every model role, the policy's tokenizer directory, and lines to
    tell the user (random weights, a critic's fresh head).

    A role not given uses the policy's model (a critic its trunk), except a reward model, which
    needs a score head: with the built-in policy it is the built-in reward model, otherwise it
    must be given. Every checkpoint is checked against its role before anything starts: a
    policy or reference needs a causal LM, a reward model a sequence classifier."""
    from flowc.runtime.modeling import checkpoint_head, has_score_head

    check_model_roles(g, given)
    from flowc.tasks.builtin import builtin_task

    policy = next((r for r, i in g.roles.items() if i.kind == RoleKind.POLICY), None)
    base = (given.get(policy) if policy else None) or builtin_task(g).model
    sources: dict[str, str] = {}
    notes: list[str] = []
    for role, info in g.roles.items():
        if info.kind in PYTHON_KINDS:
            continue
        scores = info.kind == RoleKind.REWARD_MODEL
        ref = given.get(role)
        if ref is None and scores and base not in BUILTIN_MODELS:
            raise SpecError(
                f"no model given for reward model role {role!r}; the policy's model ({base}) has no score head",
                fix=f"pass --model {role}=PATH_OR_HUB_ID of a sequence-classification checkpoint (num_labels=1)",
            )
        sources[role], note = materialize_model(ref or base, out, init=init, scores=scores)
        if note and note not in notes:
            notes.append(note)
        if info.kind in (RoleKind.POLICY, RoleKind.REFERENCE) and checkpoint_head(sources[role]) == "score":
            raise SpecError(
                f"{role}'s model {sources[role]} is a sequence-classification checkpoint (a reward model): "
                f"a {info.kind.value} needs a causal LM's head",
                fix=f"give --model {role}= a causal LM",
            )
        try:
            head = info.kind in (RoleKind.CRITIC, RoleKind.REWARD_MODEL) and has_score_head(sources[role], scores=scores)
        except SpecError as e:
            raise SpecError(f"reward model role {role!r}: {e.what}", fix=e.fix) from None
        if info.kind == RoleKind.CRITIC and not head:
            notes.append(f"{role}: a critic from the causal LM {sources[role]}: its value head starts at zero")
    tokenizer = sources[policy] if policy else str(_builtin_tokenizer())
    check_tokenizer(tokenizer, sources)
    return sources, tokenizer, notes


def _builtin_tokenizer() -> Path:
    from flowc.tasks.arithmetic import asset_dir

    return asset_dir()


# --------------------------------------------------------------------- data
def load_rows(spec: str, *, held_out: bool = False) -> Records:
    """The rows of ``--data SPEC`` (:mod:`flowc.data_source`: a file, a folder or a hub dataset
    id, with an optional subset and split; ``held_out``: the default split is ``test``).

    JSONL (and JSON) files are read here so that an error names the file and line of the
    first row that is not a JSON object or not UTF-8 text; everything else goes through
    Hugging Face ``datasets``, and an error names the row number."""
    from flowc.data_source import TEXT_FILES, DataSource, read_splits

    src = DataSource.parse(spec)
    p = src.path
    if p is not None and p.is_file() and p.suffix.lower() in TEXT_FILES:
        whole = _read_json_rows(p, src.source)
        if src.split is None:
            return whole
        lines = whole.lines or list(range(1, len(whole) + 1))
        picked = [i for _, a, b in src.instructions({"train": len(whole)}, held_out=held_out) for i in range(a, b)]
        return Records([whole.rows[i] for i in picked], src.source, lines=[lines[i] for i in picked])
    src, splits = read_splits(src)
    rows: list[dict[str, Any]] = []
    numbers: list[int] = []
    chosen = src.instructions({k: len(v) for k, v in splits.items()}, held_out=held_out)
    for split, a, b in chosen:
        rows += splits[split].select(range(a, b)).to_list()
        numbers += range(a + 1, b + 1)  # 1-based row numbers in their split
    if p is not None and p.is_file():
        name = src.source  # one file: its row numbers
    else:
        name = f"{src.source} ({'/'.join(x for x in (src.subset, '+'.join(dict.fromkeys(s for s, _, _ in chosen))) if x)})"
    if not rows:
        raise DataError(f"{name} has no rows", fix="give data with at least one row (check the split's slice)")
    return Records(rows, name, lines=numbers)


def _read_json_rows(p: Path, path: str) -> Records:
    """A JSONL file, or a JSON file holding one array of row objects."""
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e}") from None
    if p.suffix.lower() == ".json" and raw.lstrip()[:1] == b"[":
        try:
            items = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: not a JSON array of rows: {e}", fix="write a JSON array of objects, or JSONL") from None
        for k, row in enumerate(items):
            if not isinstance(row, dict):
                raise DataError(
                    f"{path}: item {k} of the array is a JSON {type(row).__name__}, not a row (a JSON object)",
                    fix='write each row as an object, e.g. {"prompt": "…", "answer": "…"}',
                )
        return Records(items, path)
    rows, lines = [], []
    for i, line in enumerate(raw.split(b"\n"), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}:{i}: not UTF-8 text ({e.reason} at byte {e.start} of the line)", fix="re-encode the file as UTF-8"
            ) from None
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i}: not JSON: {e}", fix="write one JSON object per line") from None
        if not isinstance(row, dict):
            raise DataError(
                f"{path}:{i}: a JSON {type(row).__name__} where a row (a JSON object) belongs",
                fix='write one object per line, e.g. {"prompt": "…", "answer": "…"}',
            )
        rows.append(row)
        lines.append(i)
    return Records(rows, path, lines=lines)


def required_columns(fn: Callable[..., Any]) -> list[str]:
    """The data columns a reward function cannot run without: its parameters after
    (prompts, responses) that have no default (none when it takes ``**columns``)."""
    if hasattr(fn, "columns"):  # a verl or TRL convention's adapter (flowc.rewards.adapt) names its own
        return list(fn.columns)
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    rest = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)][2:]
    return [p.name for p in rest if p.default is p.empty]


def check_rows(
    d: Records,
    tok: Any,
    *,
    prompt_len: int,
    response_len: int,
    preferences: bool,
    rewards: dict[str, tuple[Callable[..., Any], str]],
) -> None:
    """Every row of ``d`` can be used, before the first step: its prompt (and a pair's chosen
    and rejected responses) is text, fits the workload's lengths, and it has every column a
    reward reads. The error names the file and line of the first row that fails."""
    text_cols = [d.prompt_key, *(("chosen", "rejected") if preferences else ())]
    needs = {c: f"the flow's {'preference pairs' if c != d.prompt_key else 'prompts'}" for c in text_cols}
    for role, (fn, name) in rewards.items():
        for c in required_columns(fn):
            needs.setdefault(c, f"reward {role} ({name}) reads it")
    for i, row in enumerate(d.rows):
        for c, why in needs.items():
            if c not in row:
                raise DataError(
                    f"{d.where(i)}: the row has no {c!r} column, which {why} (its columns: {', '.join(row) or 'none'})",
                    fix=f"give every row a {c!r}",
                )
        for c in text_cols:
            if c == d.prompt_key and isinstance(row[c], list):
                _check_messages(d, i, row[c], tok)
            elif not isinstance(row[c], str):
                raise DataError(
                    f"{d.where(i)}: {c!r} is a {type(row[c]).__name__}, not text"
                    + (" or a list of chat messages" if c == d.prompt_key else ""),
                    fix='give it as a string, or (prompts) as [{"role": "user", "content": "…"}, …]',
                )
    _check_lengths(d, [r[d.prompt_key] for r in d.rows], tok, prompt_len, "prompt", "prompt_len", eos=False)
    if preferences:
        for c in ("chosen", "rejected"):
            _check_lengths(d, [r[c] for r in d.rows], tok, response_len, f"{c!r} response", "response_len", eos=True)


def _check_messages(d: Records, i: int, msgs: list[Any], tok: Any) -> None:
    """A chat-format prompt: role/content messages, and a tokenizer with a chat template."""
    for k, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(
                f"{d.where(i)}: message {k} of the prompt is {m!r}, not a chat message",
                fix='write each message as {"role": "user", "content": "…"}',
            )
    if not msgs:
        raise DataError(f"{d.where(i)}: the prompt is an empty list of messages", fix="give at least one message")
    if not getattr(tok, "chat_template", None):
        raise DataError(
            f"{d.where(i)}: the prompt is a list of chat messages, but the policy's tokenizer has no chat template",
            fix="use an instruct model's tokenizer (it ships a chat template), or give prompts as text",
        )


def check_data(
    g: FlowGraph,
    datasets: list[Records | None],
    tokenizer: str,
    workload: dict[str, Any],
    rewards: dict[str, Callable[..., Any]],
    names: dict[str, str],
) -> None:
    """:func:`check_rows` on every dataset of a run, with the policy's tokenizer and the plan's workload."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    preferences = reads_preferences(g)
    bound = {r: (fn, names.get(r, r)) for r, fn in rewards.items()}
    for d in datasets:
        if d is not None:
            check_rows(
                d,
                tok,
                prompt_len=int(workload["prompt_len"]),
                response_len=int(workload["response_len"]),
                preferences=preferences,
                rewards=bound,
            )


def _check_lengths(d: Records, texts: list[str], tok: Any, limit: int, what: str, knob: str, *, eos: bool) -> None:
    from flowc.runtime.data import encode_prompts, is_chat, render_prompt

    ids = [[*x, 0] for x in tok(texts, add_special_tokens=False)["input_ids"]] if eos else encode_prompts(tok, texts)
    lens = [len(x) for x in ids]
    # text the tokenizer cannot encode (dropped, or an unknown token) must not reach the model silently:
    # every row has to survive encoding and decoding (whitespace aside)
    for i, row in enumerate(ids):
        text = texts[i] if eos else render_prompt(tok, texts[i])
        if tok.bos_token and not eos and not is_chat(texts[i]) and row[:1] == [tok.bos_token_id]:
            text = tok.bos_token + text
        back = tok.decode(row[: len(row) - 1] if eos else row, skip_special_tokens=False)
        if "".join(back.split()) != "".join(text.split()):
            raise DataError(
                f"{d.where(i)}: the policy's tokenizer cannot encode the {what} {text[:60]!r} (it reads back as {back[:60]!r})",
                fix="use the tokenizer of a model trained on such text (--model actor=…); the built-in tiny model "
                "knows only digits, +, - and =",
            )
    over = [i for i, n in enumerate(lens) if n > limit]
    if over:
        i, worst = over[0], max(lens)
        raise DataError(
            f"{d.where(i)}: the {what} is {lens[i]} tokens{' with EOS' if eos else ''}, longer than the workload's {knob} "
            f"{limit} ({len(over)} of {len(d)} rows are; the longest is {worst})",
            fix=f"plan for them: --workload {knob}={worst}, or shorten those rows",
        )


def reads_preferences(g: FlowGraph) -> bool:
    """The flow's input is preference pairs (``fc.Preferences``), not prompts."""
    return any(n.op == "input" and n.kwargs.get("kind") == "preferences" for n in g.nodes)


def load_data(g: FlowGraph, data: str | None, eval_data: str | None) -> tuple[Records, Records | None]:
    """The training and held-out records: the user's files, or the built-in task's
    (prompts, or preference pairs when the flow reads ``fc.Preferences``)."""
    from flowc.tasks import arithmetic as arith
    from flowc.tasks.builtin import builtin_task

    preferences = reads_preferences(g)
    task = builtin_task(g)
    if data is None and task.name != "arithmetic":
        train_r, eval_r = task.split()
        return Records(train_r, f"built-in {task.name}"), Records(eval_r, f"built-in {task.name} (held out)")
    if data is None:
        train_p, eval_p = arith.split()
        rows_of = arith.preference_records if preferences else arith.records
        return Records(rows_of(train_p), "built-in arithmetic"), Records(rows_of(eval_p), "built-in arithmetic (held out)")
    train = load_rows(data)
    held = load_rows(eval_data, held_out=True) if eval_data else None
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
