"""Reading preference / SFT data in the accepted formats, validating it, and splitting it.

Every format becomes one canonical `Example`: the prompt as chat messages (optional system + user turns), the
chosen answer and, for preference data, the rejected answer. Stages turn examples into what their trainer wants.

Accepted rows (json / jsonl / parquet files, or a hub dataset name):
  seed            {"question": str, "chosen": str, "rejected": str}
  prompt          {"prompt": str, "chosen": str, "rejected": str}          (trl standard, explicit prompt)
  conversational  {"prompt": [msgs], "chosen": [msgs], "rejected": [msgs]} (trl conversational, explicit)
                  {"chosen": [msgs], "rejected": [msgs]}                    (trl conversational, implicit prompt)
  messages        {"messages": [msgs]}                                      (SFT only: last turn is the answer)
                  {"prompt": str | [msgs], "completion": str | [msgs]}      (SFT only)
"""

from __future__ import annotations

import codecs
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_cli.choices import DATA_FORMATS as FORMATS  # data.format's values besides auto
from rlhf_cli.errors import RlhfError

log = logging.getLogger("rlhf")

FILE_SUFFIXES = (".json", ".jsonl", ".parquet")


@dataclass
class Example:
    prompt: list[dict]          # chat messages before the answer: [system?, user, (assistant, user)...]
    chosen: str                 # the (preferred) answer
    rejected: str | None = None
    extra: dict = field(default_factory=dict)  # the row's other fields (e.g. a reference answer), for reward
                                               # functions and ground-truth checkers


# ---------------------------------------------------------------------------------------------------- reading
_ROW_KEYS = ("question", "prompt", "chosen", "rejected", "messages", "completion")  # what to_example reads


class Rows(list):
    """A plain list of row dicts that also remembers where each row came from, so that an error about a row
    can point at it: `lines[i]` is the 1-based file line of row i (jsonl, blank lines counted), or `lines`
    is None where a file has no lines to point at (json list, parquet, hub dataset: the row number is used)."""

    def __init__(self, rows=(), lines: list[int] | None = None):
        super().__init__(rows)
        self.lines = lines


def _where(rows: list[dict], i: int) -> str:
    """'line N' (the file line of row i, 0-based i) when the rows know it, else 'row i+1'."""
    lines = getattr(rows, "lines", None)
    return f"line {lines[i]}" if lines is not None and i < len(lines) else f"row {i + 1}"


def read_rows(path: str, split: str = "train") -> Rows:
    """Rows of a json / jsonl / parquet file, or of a hub dataset; errors name the file and line. The list is
    a `Rows`, which carries each row's file line for later errors."""
    if not path:
        raise RlhfError("data.train_path is not set: give a json/jsonl/parquet file, e.g. data.train_path=pairs.jsonl")
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix == ".jsonl":
            return _read_jsonl(p)
        if p.suffix == ".json":
            return _read_json(p)
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                return Rows(pq.read_table(p).to_pylist())
            except Exception as e:  # noqa: BLE001
                raise RlhfError(f"{p}: not a readable parquet file ({type(e).__name__}: {e})") from e
        raise RlhfError(f"{p}: unsupported file type '{p.suffix}'; use .jsonl, .json or .parquet")
    if not is_hub_name(path):
        raise RlhfError(f"data file {p} does not exist; check data.train_path / data.eval_path")
    return _read_hub_dataset(path, split)


def is_hub_name(path: str) -> bool:
    """A data path that is no local file and not written as one: a hub dataset's name (`org/name`)."""
    p = Path(path).expanduser()
    if p.is_file():
        return False
    return not (p.suffix in FILE_SUFFIXES or "/" in path and (path.startswith((".", "/", "~")) or p.parent.exists()))


def check_files(data_cfg) -> None:
    """Read and convert the local data files (`data.train_path`, `data.eval_path`) once, before the stage
    imports its libraries (seconds of torch / transformers / trl): a missing, unreadable or malformed file is
    one line at once rather than after them. Hub datasets are left to the stage (loading one needs `datasets`);
    the stage's checks that depend on what it trains (rejected answers, ties) stay with it."""
    same_files(data_cfg.get("train_path"), data_cfg.get("eval_path"))
    for path in (data_cfg.get("train_path"), data_cfg.get("eval_path")):
        if not path or is_hub_name(str(path)):
            continue
        rows = read_rows(str(path))
        previous = log.level
        log.setLevel(logging.ERROR)  # the stage converts the rows again and warns about dropped ones then
        try:
            to_examples(rows, data_cfg.format, str(path), data_cfg.get("system_prompt"))
        finally:
            log.setLevel(previous)


# what each command measures on held-out rows (PPO only while ppo.eval_every > 0)
_HELD_OUT_USE = {"sft": "rlhf sft measures its eval loss on them", "reward": "rlhf reward measures its eval "
                 "accuracy on them", "dpo": "rlhf dpo measures its eval loss and accuracy on them",
                 "eval": "rlhf eval compares the policies on them",
                 "ppo": "ppo.eval_every evaluates on them (ppo.eval_every=0 turns that off)"}


def check_held_out(run) -> None:
    """`data.eval_ratio=0` without `data.eval_path` holds no rows out: one line where the command needs them
    (`run`: the run's settings, rlhf_cli.settings.of)."""
    d, command = run.data, str(run.command)
    if d.get("eval_path") or float(d.get("eval_ratio") or 0) > 0 or command not in _HELD_OUT_USE:
        return
    if command == "ppo" and not int(run.ppo.eval_every):
        return
    raise RlhfError(f"data.eval_ratio=0 holds no rows out, and {_HELD_OUT_USE[command]}: give data.eval_path, or "
                    "data.eval_ratio above 0")


def same_files(train_path, eval_path) -> None:
    """An eval file that is the train file (the same path, or the same bytes) is refused: its "held-out" metrics
    would be measured on training rows."""
    if not train_path or not eval_path:
        return
    t, e = Path(str(train_path)).expanduser(), Path(str(eval_path)).expanduser()
    if not (t.is_file() and e.is_file()):
        return
    if t.resolve() == e.resolve() or (t.stat().st_size == e.stat().st_size and t.read_bytes() == e.read_bytes()):
        raise RlhfError(f"data.eval_path={eval_path} holds the same rows as data.train_path={train_path}, so "
                        "held-out metrics would be measured on training rows; give another eval file, or "
                        "data.eval_path=null to hold data.eval_ratio of the train file out")


def _read_text(p: Path) -> str:
    """The file as UTF-8 text, a byte-order mark dropped (editors on Windows write one). Anything else is
    refused with the line of the first bad byte and the command that converts it."""
    try:
        data = p.read_bytes()
    except OSError as e:
        raise RlhfError(f"data file {p} cannot be read ({e.strerror}); check its permissions "
                        "(data.train_path / data.eval_path)") from None
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        source = "UTF-16" if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) else "GBK"
        raise RlhfError(f"{p}: not UTF-8 (line {line}); convert it, e.g. "
                        f"`iconv -f {source} -t UTF-8 {p} > fixed{p.suffix}`") from None


def _read_jsonl(p: Path) -> Rows:
    rows, lines = [], []
    # split on \n alone, as editors number lines (not on the other breaks str.splitlines knows); a CRLF
    # line's \r is whitespace to json
    for n, line in enumerate(_read_text(p).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RlhfError(f"{p}:{n}: malformed JSON ({e.msg} at column {e.colno}); fix or remove that line") from e
        if not isinstance(row, dict):
            raise RlhfError(f"{p}:{n}: expected a JSON object per line, got {type(row).__name__}")
        rows.append(row)
        lines.append(n)
    return Rows(rows, lines)


def _read_json(p: Path) -> Rows:
    try:
        obj = json.loads(_read_text(p))
    except json.JSONDecodeError as e:
        raise RlhfError(f"{p}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from e
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list) or not all(isinstance(r, dict) for r in obj):
        raise RlhfError(f"{p}: expected a JSON list of objects (or {{\"data\": [...]}}); "
                        "use .jsonl for one object per line")
    return Rows(obj)


def _read_hub_dataset(name: str, split: str) -> Rows:
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - offline, unknown name, bad split all end here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RlhfError(f"could not load dataset '{name}' (split {split}): {first}; "
                        "give a local json/jsonl/parquet file instead") from e
    return Rows(dict(r) for r in ds)


# ------------------------------------------------------------------------------------------------- formats
def detect_format(row: dict) -> str | None:
    if {"question", "chosen", "rejected"} <= row.keys():
        return "seed"
    if {"chosen", "rejected"} <= row.keys():
        if isinstance(row["chosen"], list):
            return "conversational"
        if "prompt" in row:
            return "prompt"
    if "messages" in row or {"prompt", "completion"} <= row.keys():
        return "messages"
    return None


_REQUIRED = {
    "seed": ("question", "chosen", "rejected"),
    "prompt": ("prompt", "chosen", "rejected"),
    "conversational": ("chosen", "rejected"),
    "messages": ("messages | prompt+completion",),
}


def _as_messages(x, role: str) -> list[dict]:
    if isinstance(x, str):
        return [{"role": role, "content": x}]
    return [{"role": m["role"], "content": m["content"]} for m in x]


def _answer(msgs) -> str:
    if isinstance(msgs, str):
        return msgs
    if not msgs or msgs[-1].get("role") != "assistant":
        raise ValueError("the last message must be the assistant's answer")
    return msgs[-1]["content"]


def to_example(row: dict, fmt: str) -> Example:
    if fmt == "seed":
        return Example(_as_messages(row["question"], "user"), row["chosen"], row["rejected"])
    if fmt == "prompt":
        return Example(_as_messages(row["prompt"], "user"), _answer(row["chosen"]), _answer(row["rejected"]))
    if fmt == "conversational":
        if "prompt" in row:
            return Example(_as_messages(row["prompt"], "user"), _answer(row["chosen"]), _answer(row["rejected"]))
        # implicit prompt: everything before the final assistant turn (shared by chosen and rejected)
        return Example(_as_messages(row["chosen"][:-1], "user"), _answer(row["chosen"]), _answer(row["rejected"]))
    if "messages" in row:
        msgs = _as_messages(row["messages"], "user")
        return Example(msgs[:-1], _answer(msgs))
    return Example(_as_messages(row["prompt"], "user"), _answer(row["completion"]))


def to_examples(rows: list[dict], fmt: str, source: str, system_prompt: str | None = None) -> list[Example]:
    """Validate and convert rows; an error names `source` and the row's file line when `rows` is a `Rows`
    from a jsonl file (else its 1-based row number)."""
    if not rows:
        raise RlhfError(f"{source}: the dataset is empty; give a file with at least one row")
    if fmt == "auto":
        fmt = detect_format(rows[0]) or ""
        if not fmt:
            raise RlhfError(f"{source}: {_where(rows, 0)} has keys {sorted(rows[0])}, which match no known "
                            "format; expected question/chosen/rejected, prompt/chosen/rejected, chosen/rejected "
                            "messages, or messages")
    elif fmt not in FORMATS:
        raise RlhfError(f"data.format={fmt} is unknown; choose auto or one of {', '.join(FORMATS)}")
    out = []
    for i, row in enumerate(rows):
        where = _where(rows, i)
        if detect_format(row) != fmt and not (fmt == "seed" and {"question", "chosen", "rejected"} <= row.keys()):
            missing = [k for k in _REQUIRED[fmt][0].split(" | ")[0].split("+") if k not in row] \
                if fmt == "messages" else [k for k in _REQUIRED[fmt] if k not in row]
            raise RlhfError(f"{source}: {where} is missing required key(s) {', '.join(missing) or _REQUIRED[fmt]} "
                            f"for the {fmt} format (found {', '.join(sorted(row)) or 'none'})")
        _check_field_types(row, source, where)
        try:
            ex = to_example(row, fmt)
        except (KeyError, TypeError, ValueError) as e:
            raise RlhfError(f"{source}: {where}: {e} ({fmt} format)") from e
        ex.extra = {k: v for k, v in row.items() if k not in _ROW_KEYS}
        if not isinstance(ex.chosen, str) or (fmt != "messages" and not isinstance(ex.rejected, str)):
            raise RlhfError(f"{source}: {where}: the answers must be strings (chosen is {type(ex.chosen).__name__}"
                            f"{'' if fmt == 'messages' else ', rejected is ' + type(ex.rejected).__name__}; "
                            f"{fmt} format)")
        if _is_empty(ex):
            continue
        if system_prompt and not any(m["role"] == "system" for m in ex.prompt):
            ex.prompt = [{"role": "system", "content": system_prompt}, *ex.prompt]
        out.append(ex)
    if len(out) < len(rows):
        log.warning("%s: dropped %d of %d rows with an empty prompt", source, len(rows) - len(out), len(rows))
    if not out:
        raise RlhfError(f"{source}: every row has an empty prompt")
    return out


_TEXT_KEYS = ("question", "prompt", "chosen", "rejected", "completion", "messages")


def _check_field_types(row: dict, source: str, where: str) -> None:
    """A text field that is null or a number is an error naming the key (not a TypeError from deep inside)."""
    for k in _TEXT_KEYS:
        if k in row and not isinstance(row[k], (str, list, dict)):
            what = "null" if row[k] is None else f"a {type(row[k]).__name__} ({row[k]!r})"
            raise RlhfError(f"{source}: {where}: '{k}' is {what}; give a string or a list of chat messages")


def _is_empty(ex: Example) -> bool:
    """No prompt text: nothing to answer."""
    return not "".join(str(m.get("content") or "") for m in ex.prompt if isinstance(m, dict)).strip()


def drop_empty_answers(examples: list[Example], source: str, rejected: bool) -> list[Example]:
    """Rows whose chosen answer (or, for pairs, rejected answer) is empty teach nothing: counted and dropped."""
    keep = [ex for ex in examples if ex.chosen.strip() and not (rejected and not (ex.rejected or "").strip())]
    if len(keep) < len(examples):
        log.warning("%s: dropped %d of %d rows with an empty answer", source, len(examples) - len(keep),
                    len(examples))
    return keep


# --------------------------------------------------------------------------------------------------- loading
def load_examples(data_cfg, need_rejected: bool = True,
                  need_answers: bool = True) -> tuple[list[Example], list[Example]]:
    """Train and eval examples from `data.*`: eval from `eval_path`, else a seeded `eval_ratio` split. Rows with
    an empty answer are dropped where the stage trains on answers (`need_answers`; PPO reads prompts only)."""
    train = to_examples(read_rows(data_cfg.train_path, data_cfg.split), data_cfg.format,
                        str(data_cfg.train_path), data_cfg.system_prompt)
    if data_cfg.eval_path:
        evals = to_examples(read_rows(data_cfg.eval_path, "test"), data_cfg.format,
                            str(data_cfg.eval_path), data_cfg.system_prompt)
    else:
        idx = list(range(len(train)))
        random.Random(int(data_cfg.split_seed)).shuffle(idx)
        ratio = float(data_cfg.eval_ratio)  # 0: no held-out rows at all
        n_eval = max(1, int(round(len(train) * ratio))) if len(train) > 1 and ratio > 0 else 0
        evals = [train[i] for i in idx[:n_eval]]
        train = [train[i] for i in idx[n_eval:]]
    if need_rejected:
        for name, exs in (("train", train), ("eval", evals)):
            if exs and exs[0].rejected is None:
                path = data_cfg.train_path if name == "train" else data_cfg.eval_path or data_cfg.train_path
                raise RlhfError(f"data.{name}_path has no rejected answers ({path}): this stage needs preference "
                                "pairs; give rows with question/chosen/rejected or prompt/chosen/rejected")
        train = drop_ties(train, str(data_cfg.train_path))
        evals = drop_ties(evals, str(data_cfg.eval_path or data_cfg.train_path))
    if need_answers:
        train = drop_empty_answers(train, str(data_cfg.train_path), need_rejected)
        evals = drop_empty_answers(evals, str(data_cfg.eval_path or data_cfg.train_path), need_rejected)
    if data_cfg.max_rows:
        train = train[: int(data_cfg.max_rows)]
    if data_cfg.get("max_eval_rows"):  # .get: a data group of its own may lack the key
        evals = evals[: int(data_cfg.get("max_eval_rows"))]
    if not train:
        raise RlhfError(f"{data_cfg.train_path}: no training rows left after splitting/filtering")
    return train, evals


def drop_ties(examples: list[Example], source: str) -> list[Example]:
    kept = [e for e in examples if e.chosen.strip() != (e.rejected or "").strip()]
    if len(kept) < len(examples):
        log.warning("%s: dropped %d of %d pairs whose chosen and rejected answers are identical",
                    source, len(examples) - len(kept), len(examples))
    if examples and not kept:
        raise RlhfError(f"{source}: every pair has chosen == rejected; a preference pair needs two different answers")
    return kept


def prompt_text(tokenizer, messages: list[dict], enable_thinking: bool = False, chat_template: bool = True) -> str:
    """The one way a prompt is rendered in every stage: the chat template plus the assistant header
    (`data.chat_template=false`: the plain message texts, for base models without a template)."""
    if not chat_template:
        return "\n".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)


def pair_rows(examples: list[Example], tokenizer, enable_thinking: bool = False,
              chat_template: bool = True) -> list[dict]:
    """Preference pairs in trl's standard explicit format (the reward and DPO trainers): the prompt rendered as
    every stage renders it (`prompt_text`), the answers as text; trl appends EOS to each answer, so the pair is
    exactly the token sequence a policy samples (prompt, response, EOS)."""
    return [{"prompt": prompt_text(tokenizer, ex.prompt, enable_thinking, chat_template), "chosen": ex.chosen,
             "rejected": ex.rejected} for ex in examples]


def filter_long_prompts(examples: list[Example], tokenizer, max_prompt_length: int, source: str,
                        enable_thinking: bool = False, chat_template: bool = True) -> list[Example]:
    """Drop examples whose rendered prompt exceeds `max_prompt_length` tokens, and say how many."""
    kept = [e for e in examples
            if len(tokenizer(prompt_text(tokenizer, e.prompt, enable_thinking, chat_template),
                             add_special_tokens=False)["input_ids"]) <= max_prompt_length]
    if len(kept) < len(examples):
        log.warning("%s: dropped %d of %d examples whose prompt is longer than data.max_prompt_length=%d tokens",
                    source, len(examples) - len(kept), len(examples), max_prompt_length)
    if examples and not kept:
        raise RlhfError(f"{source}: every prompt is longer than data.max_prompt_length={max_prompt_length} tokens; "
                        "raise data.max_prompt_length")
    return kept
