"""``eesd heads train|eval|build|info|corpus``: exit heads for the early-exit drafter, and their teacher corpus."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from eesd_local.base.atomic import check_overwrite
from eesd_local.base.errors import EesdError
from eesd_local.base.interrupts import interrupt_for, terminate_as_interrupt
from eesd_local.base.params import MAX_THREADS, check_int, check_number
from eesd_local.base.paths import cache_dir, models_dir
from eesd_local.gguf.headfile import (
    build_draft,
    check_exit_layer,
    check_head_for,
    exit_block_mb,
    find_head,
    fingerprint,
    model_info,
    read_head_info,
)
from eesd_local.llama.catalog import get_spec, is_present, known_models
from eesd_local.llama.draftvocab import DRAFT_VOCAB
from eesd_local.tools.heads import corpus, data, evaluate, targets, teacher, train
from eesd_local.tools.heads.corpus import DEFAULT_MAX_MB, GrowConfig
from eesd_local.tools.heads.data import DEFAULT_MIX, DEFAULT_TRAIN_VOCAB, MIXES
from eesd_local.tools.heads.shards import TRUNK_SOURCES
from eesd_local.tools.registry import resolve_model

MAX_NEW = 1024  # answer tokens per prompt: the draft is run over prompt (up to 1024 tokens) + answer in 2048
HEAD_MB = 20.0  # a head that fits in the repository beside its model (models/README.md)
MAX_PARALLEL = 256  # sequences in one llama.cpp context; each holds max_prompt + max_new cells of KV


def register(subparsers) -> None:
    p = subparsers.add_parser("heads", help="train, evaluate and inspect exit heads (EESD drafter)")
    sub = p.add_subparsers(dest="heads_command", metavar="ACTION")
    sub.required = True

    t = sub.add_parser("train", help="train an exit head by self-distillation")
    t.add_argument("--model", "-m", required=True, help="registry name or GGUF path of the base model")
    t.add_argument(
        "--exit-layer",
        "-n",
        type=int,
        required=True,
        help="N: the draft runs blocks 0..N-1 of the base plus the trained exit block",
    )
    t.add_argument("-o", "--output", required=True, type=Path, help="head GGUF to write")
    t.add_argument("--data", type=Path, default=None, help="directory of teacher shards (default: the cache, per model)")
    t.add_argument(
        "--minutes",
        type=float,
        default=55.0,
        help="wall-clock budget for the whole run (teacher, trunk states, training; default 55): the teacher "
        "stops when the training of what it made would overrun it, and training shortens its schedule to fit",
    )
    t.add_argument(
        "--tokens", type=int, default=None, help="at most this many teacher tokens on disk (default: as many as --minutes allows)"
    )
    t.add_argument("--teacher-minutes", type=float, default=None, help="stop generating teacher data after this long")
    t.add_argument(
        "--corpus",
        nargs="?",
        const="",
        default=None,
        metavar="FOLDER",
        help="train on the teacher corpus (models/corpus/MODEL, or FOLDER) with hard targets, the model's greedy "
        "answer tokens; no teacher runs (eesd heads corpus grow adds answers)",
    )
    t.add_argument("--corpus-shards", type=int, default=None, metavar="N",
                   help="train on the corpus' first N shards only: the corpus as it was when a head was made "
                        "(eesd heads info HEAD names its corpus_shards); default: every shard")
    t.add_argument("--init-head", type=Path, default=None, help="start from this head's exit block (more data for a head)")
    t.add_argument("--mix", choices=sorted(MIXES), default=DEFAULT_MIX, help=f"training data (default {DEFAULT_MIX})")
    t.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help=f"train the softmax over the shared trunk's draft vocabulary of this size (0: the full vocabulary; "
        f"default {DRAFT_VOCAB} with --corpus, where the full loss over every row would cost 3.5x a step, else "
        f"{DEFAULT_TRAIN_VOCAB})",
    )
    t.add_argument(
        "--mlp",
        choices=["auto", "train", "base"],
        default="auto",
        help="the exit block's MLP: train it, or keep the base's last block's (the head file then omits it: the "
        f"1.5B's head is 5.9 MB, not 50). auto (default): train it when the head stays within {HEAD_MB} MB",
    )
    t.add_argument(
        "--trunk-states",
        choices=["auto", *TRUNK_SOURCES],
        default="auto",
        help="where the trunk states h_N come from: llama.cpp (the model's own trunk and kernels, as the runtime "
        "computes them; 1.65x torch's speed on the 1.5B) or torch (float32 weights dequantised from the GGUF). "
        "auto (default): torch with --device cuda, else llama.cpp",
    )
    t.add_argument("--epochs", type=float, default=3.0)
    t.add_argument("--steps", type=int, default=0,
                   help="train exactly this many steps (default: as many as --epochs make; --minutes still shortens)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3 with --corpus, else 3e-4)")
    t.add_argument("--loss", choices=["sampled", "full"], default=None,
                   help="sampled: softmax over the teacher's top-k and sampled negatives; full: over every row the "
                        "head can propose (V' with --draft-vocab): slower a step, more agreement a step "
                        "(default: full with --corpus, else sampled)")
    t.add_argument("--batch-tokens", type=int, default=2048)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--parallel", type=int, default=16, help="sequences the teacher generates together")
    t.add_argument("--max-new", type=int, default=320, help="answer tokens the teacher generates per request")
    t.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    t.add_argument("--force", action="store_true", help="overwrite the output head")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="agreement of a head's draft with the model's own greedy output, and implied tau")
    e.add_argument("--model", "-m", required=True)
    e.add_argument("--head", required=False, type=Path, default=None, help="head GGUF (default: the shipped head for the model)")
    e.add_argument(
        "--prompts", type=Path, default=None, help="JSONL with id, category, prompt|messages (default: models/eval_prompts.jsonl)"
    )
    e.add_argument("--max-new", type=int, default=128)
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--cost", type=float, default=None, help="draft/target cost per token (default: measured)")
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("build", help="build (or find cached) the draft GGUF for base + head")
    b.add_argument("--model", "-m", required=True)
    b.add_argument("--head", type=Path, default=None)
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    b.set_defaults(func=cmd_build)

    i = sub.add_parser("info", help="show a head's metadata")
    i.add_argument("head", type=Path)
    i.set_defaults(func=cmd_info)

    _register_corpus(sub)


def _register_corpus(sub) -> None:
    c = sub.add_parser("corpus", help="the teacher corpus: the model's own greedy answers, kept in models/corpus/")
    csub = c.add_subparsers(dest="corpus_command", metavar="ACTION")
    csub.required = True
    g = csub.add_parser(
        "grow",
        help="answer prompts not yet in the corpus and add the answers (resumable: Ctrl-C or kill, then run it again)",
    )
    g.add_argument("--model", "-m", required=True, help="registry name or GGUF path of the model that answers")
    g.add_argument("--minutes", type=float, default=None, help="stop after this long (default: at --max-mb, or when the prompts run out)")
    g.add_argument("--max-mb", type=float, default=DEFAULT_MAX_MB,
                   help=f"size budget of this model's corpus in MB (default {DEFAULT_MAX_MB:g}: the two demo models' corpora stay "
                   "under ~20 MB in git)")
    g.add_argument("--n-parallel", type=int, default=GrowConfig.n_parallel,
                   help=f"sequences decoded together (default {GrowConfig.n_parallel}: the most tokens/s measured, models/README.md)")
    g.add_argument("--max-new", type=int, default=GrowConfig.max_new, help=f"answer tokens per prompt at most (default {GrowConfig.max_new})")
    g.add_argument("--threads", type=int, default=2,
                   help="llama.cpp threads (default 2). Beside other work use 1, or set OMP_WAIT_POLICY=PASSIVE: a waiting "
                   "thread spins at each of the graph's barriers while its partner has lost its core (10-70x slower, "
                   "models/README.md)")
    g.add_argument("--corpus", type=Path, default=None, help="corpus folder (default: models/corpus/MODEL)")
    g.set_defaults(func=cmd_corpus_grow)

    ci = csub.add_parser("info", help="what a corpus holds: shards, answers, tokens, bytes, prompts by source")
    ci.add_argument("--model", "-m", default=None, help="registry name or GGUF path (default: every corpus in models/corpus/)")
    ci.add_argument("--corpus", type=Path, default=None, help="corpus folder (default: models/corpus/MODEL)")
    ci.add_argument("--json", action="store_true", help="print the figures as JSON")
    ci.set_defaults(func=cmd_corpus_info)


def _head_for(model_path: Path, head: Path | None) -> Path:
    if head is not None:
        return head
    found = find_head(model_path)
    if found is None:
        raise EesdError(
            f"no exit head found for {model_path.name}",
            hint="pass --head HEAD.gguf, or train one: eesd heads train --model MODEL --exit-layer N -o HEAD.gguf",
        )
    return found


def cmd_train(args: argparse.Namespace) -> int:
    t_start = time.time()
    deadline = t_start + args.minutes * 60
    model = resolve_model(args.model)
    info = model_info(model)
    check_exit_layer(args.exit_layer, info["n_layer"], args.model)
    check_overwrite(args.output, args.force)
    if args.minutes <= 0:
        raise EesdError("--minutes must be positive")
    if args.device == "cuda":
        import torch  # noqa: PLC0415 - torch: optional (train extra)

        if not torch.cuda.is_available():
            raise EesdError("--device cuda was asked for but PyTorch sees no CUDA device", hint="use --device cpu")
    if args.init_head is not None:
        check_head_for_training(model, args.init_head, args.exit_layer)
    if args.corpus_shards is not None and args.corpus is None:
        raise EesdError("--corpus-shards picks shards of the teacher corpus", hint="add --corpus")
    if args.corpus is not None:
        return _train_from_corpus(args, model, deadline, t_start)
    data_dir = args.data or cache_dir("heads-data") / fingerprint(model) / args.mix
    cap = f"at most {args.tokens} tokens, " if args.tokens else ""
    print(f"teacher data: {data_dir} ({cap}mix {args.mix}; {args.minutes:g} min for the whole run)", file=sys.stderr)
    cfg = teacher.TeacherConfig(n_parallel=args.parallel, threads=args.threads, max_new=args.max_new)

    with Progress(TextColumn("teacher: {task.fields[line]}"), console=Console(stderr=True)) as bar:
        task = bar.add_task("teacher", total=None, line="starting")

        def tprog(d: dict) -> None:
            left = max(0.0, deadline - time.time()) / 60
            bar.update(task, line=f"{d['tokens']} tokens, {d['new'] / max(d['elapsed'], 1e-9):.1f} tok/s, "
                                  f"{left:.0f} min of the budget left")

        teacher.run_teacher(
            model,
            data.mix_items(args.mix),
            data_dir,
            cfg=cfg,
            budget_tokens=args.tokens or 10**12,
            time_limit_s=(args.teacher_minutes or 1e9) * 60,
            progress=tprog,
            stop_when=train.teacher_stop_rule(deadline, args.epochs),  # the rest must still fit in --minutes
        )
    if teacher.count_tokens(data_dir) == 0:
        raise EesdError(
            f"no teacher data was made within --minutes {args.minutes:g}", hint="give the run more minutes (--minutes)"
        )
    return _train(args, model, data_dir, {"teacher_tokens": teacher.count_tokens(data_dir), "mix": data.MIXES[args.mix]},
                  deadline, t_start)


def freeze_mlp_for(info: dict, asked: str) -> bool:
    """Whether the exit block keeps the base's last MLP: ``--mlp base``, or auto when training it would make
    the head file larger than HEAD_MB."""
    if asked != "auto":
        return asked == "base"
    attn_mb, mlp_mb = exit_block_mb(info)
    return attn_mb + mlp_mb > HEAD_MB


def trunk_source_for(args: argparse.Namespace) -> str:
    """``--trunk-states``: auto is torch where training runs on a GPU, else llama.cpp (the faster on a CPU)."""
    if args.trunk_states != "auto":
        return str(args.trunk_states)
    return "torch" if args.device == "cuda" else "llama.cpp"


def check_head_for_training(model: Path, head: Path, exit_layer: int) -> None:
    info, _ = check_head_for(model, head)
    if int(info["exit_layer"]) != exit_layer:
        raise EesdError(f"--init-head {head} exits after layer {info['exit_layer']}, not {exit_layer}",
                        hint=f"use --exit-layer {info['exit_layer']}")


def _train_from_corpus(args: argparse.Namespace, model: Path, deadline: float, t_start: float) -> int:
    folder = Path(args.corpus) if args.corpus else corpus.corpus_dir_for(args.model, model)
    if not corpus.shard_paths(folder):
        raise EesdError(f"no corpus shards in {folder}", hint=f"eesd heads corpus grow --model {args.model}")
    with Progress(TextColumn("corpus targets"), BarColumn(), TextColumn("{task.completed}/{task.total} answers"),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task("targets", total=None)
        got = targets.build(model, folder, cache_dir("heads-data") / fingerprint(model),
                            progress=lambda i, n: bar.update(task, completed=i, total=n), first=args.corpus_shards)
    if not got.answers:
        raise EesdError(f"no answer of {folder} could be used: {got.left_out}")
    left = "; left out: " + ", ".join(f"{n} ({why})" for why, n in got.left_out.items()) if got.left_out else ""
    print(f"corpus {folder} (its first {got.shards} shards, to {got.last_shard}): {got.answers} answers, {got.answer_tokens} answer tokens (hard targets){left}", file=sys.stderr)
    return _train(args, model, got.folder, got.summary(), deadline, t_start, corpus=True)


def _train(args: argparse.Namespace, model: Path, data_dir: Path, data_summary: dict, deadline: float, t_start: float,
           *, corpus: bool = False) -> int:
    """Trunk states, then training; hard corpus targets get the corpus recipe's defaults (models/README.md)."""
    source = trunk_source_for(args)
    train.cache_trunk_states(
        model, data_dir, (args.exit_layer,), threads=args.threads, progress=lambda m: print(m, file=sys.stderr),
        device=args.device, source=source,
    )
    tcfg = train.TrainConfig(
        exit_layer=args.exit_layer,
        epochs=args.epochs,
        steps=args.steps,
        lr=args.lr if args.lr is not None else (1e-3 if corpus else 3e-4),
        loss=args.loss or ("full" if corpus else "sampled"),
        batch_tokens=args.batch_tokens,
        threads=args.threads,
        draft_vocab=args.draft_vocab if args.draft_vocab is not None else (DRAFT_VOCAB if corpus else DEFAULT_TRAIN_VOCAB),
        batch_negatives=corpus,
        trunk_source=source,
        freeze_mlp=freeze_mlp_for(info := model_info(model), args.mlp),
    )
    attn_mb, mlp_mb = exit_block_mb(info)
    mlp = "kept from the base's last block" if tcfg.freeze_mlp else "trained"
    print(f"exit block: attention trained, MLP {mlp} (head file ~{attn_mb + (0 if tcfg.freeze_mlp else mlp_mb):.1f} MB; "
          f"--mlp {args.mlp})", file=sys.stderr)
    summary = train.train_head(
        model,
        data_dir,
        args.output,
        tcfg,
        device=args.device,
        ckpt_path=cache_dir("heads-ckpt") / f"{args.output.name}.{fingerprint(model)[:12]}.ckpt",
        log=lambda m: print(m, file=sys.stderr),
        data_summary=data_summary,
        force=args.force,
        deadline=deadline,
        init_head=args.init_head,
    )
    summary["wall_minutes"] = round((time.time() - t_start) / 60, 1)
    print(
        json.dumps(
            {
                k: summary[k]
                for k in ("steps", "planned_steps", "epochs", "train_tokens", "final_loss", "agreement", "throughput_tok_s", "wall_minutes")
            },
            indent=1,
        )
    )
    print(f"wrote {args.output}")
    return 130 if summary.get("interrupted") else 0


def cmd_eval(args: argparse.Namespace) -> int:
    check_int("--max-new", args.max_new, 1, MAX_NEW, hint="answer tokens per prompt, e.g. --max-new 128")
    check_int("--threads", args.threads, 1, MAX_THREADS, hint="e.g. --threads 2")
    if args.cost is not None:
        check_number("--cost", args.cost, 0.0, lo_open=True, hint="a draft token's cost over a target token's, e.g. "
                     "--cost 0.3, or leave it out to measure it")
    model = resolve_model(args.model)
    head = _head_for(model, args.head)
    prompts = args.prompts or models_dir() / "eval_prompts.jsonl"
    with terminate_as_interrupt():  # SIGTERM stops it as Ctrl-C does (exit 143), before any report is printed
        rep = evaluate.evaluate(model, head, prompts, max_new=args.max_new, threads=args.threads, cost=args.cost)
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0
    print(f"head {head}  draft {rep['draft']}")
    if rep["cost_ratio"] is not None:
        print(f"draft cost per token / target: {rep['cost_ratio']:.3f}")
    print(f"memory-bound projection (a PROJECTION, not a measurement): a draft step reads s = "
          f"{rep['memory_bound_share']:.3f} of a target step; {rep['memory_bound_formula']}")
    for cat, e in rep["categories"].items():
        print(f"\n[{cat}] {e['sequences']} answers, {e['tokens']} tokens, top-1 agreement {e['agreement']:.3f} "
              f"(over the shared trunk's V' of {rep['draft_vocab']}: {e['agreement_vprime']:.3f})")
        print("  k:          " + " ".join(f"{k:>6}" for k in range(1, 9)))
        print("  tau (runs): " + " ".join(f"{e['tau_runs'][k]:>6.2f}" for k in range(1, 9)))
        print("  tau (iid):  " + " ".join(f"{e['tau_iid'][k]:>6.2f}" for k in range(1, 9)))
        mb = e["speedup_memory_bound"]
        print("  projected, memory-bound, shared trunk: " + " ".join(f"{mb[k]:>6.2f}" for k in range(1, 9))
              + f"  (best k = {e['best_k_memory_bound']})")
        if "speedup_gpu_like" in e:
            print("  speedup GPU-like: " + " ".join(f"{e['speedup_gpu_like'][k]:>6.2f}" for k in range(1, 9)))
            print("  speedup this CPU: " + " ".join(f"{e['speedup_cpu'][k]:>6.2f}" for k in range(1, 9)))
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    print(build_draft(model, _head_for(model, args.head), force=args.force))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    info = read_head_info(args.head)
    info.pop("history", None)
    print(json.dumps(info, indent=1, default=str))
    return 0


def _corpus_model(name: str) -> tuple[Path | None, Path]:
    """(the model's GGUF if it is on this machine, its corpus folder): a registry model not yet downloaded
    still has a corpus to show."""
    if name in known_models() and not is_present(get_spec(name)):
        return None, corpus.corpus_dir_for(name, None)
    path = resolve_model(name)
    return path, corpus.corpus_dir_for(name, path)


def _eta(seconds: float) -> str:
    if seconds == float("inf") or seconds != seconds:
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def cmd_corpus_grow(args: argparse.Namespace) -> int:
    check_int("--n-parallel", args.n_parallel, 1, MAX_PARALLEL, hint=f"e.g. --n-parallel {GrowConfig.n_parallel}")
    check_int("--max-new", args.max_new, 1, MAX_NEW, hint=f"e.g. --max-new {GrowConfig.max_new}")
    check_int("--threads", args.threads, 1, MAX_THREADS, hint="e.g. --threads 2")
    check_number("--max-mb", args.max_mb, 0.0, lo_open=True, hint=f"e.g. --max-mb {DEFAULT_MAX_MB:g}")
    if args.minutes is not None:
        check_number("--minutes", args.minutes, 0.0, lo_open=True, hint="e.g. --minutes 60, or leave it out to run to --max-mb")
    if args.corpus is not None:  # before a registry model is pulled or any model loads
        corpus.check_writable(args.corpus)
    model, folder = _corpus_model(args.model)
    if model is None:  # grow needs the model itself

        model = resolve_model(args.model)
    folder = args.corpus or folder
    corpus.check_writable(folder)
    cfg = corpus.GrowConfig(n_parallel=args.n_parallel, max_new=args.max_new, threads=args.threads)
    max_bytes = int(args.max_mb * 1e6)
    err = Console(stderr=True)
    if not err.is_terminal:  # a log file: one line per report, not wrapped at 80 columns
        err = Console(stderr=True, width=200)
    limit = f"{args.minutes:g} min or {args.max_mb:g} MB" if args.minutes else f"{args.max_mb:g} MB"
    err.print(f"growing {folder} with {model.name}: {cfg.n_parallel} sequences together, {cfg.threads} thread{'s' * (cfg.threads > 1)}, "
              f"until {limit} (Ctrl-C stops it; run it again to go on)", highlight=False)
    last_log = [time.monotonic()]

    def on_skip(path: Path, why: str) -> None:
        err.print(f"warning: corpus shard {path} skipped: {why}", highlight=False)

    columns = (TextColumn("corpus"), BarColumn(), TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("corpus", total=1.0, status="loading the model and the prompts")

        def progress(d: dict) -> None:
            bytes_rate = d["tok_s"] * d["bytes"] / max(d["corpus_tokens"], 1)
            eta = min(d["deadline_s"], (d["max_bytes"] - d["bytes"]) / bytes_rate if bytes_rate > 0 else float("inf"))
            done = max(d["bytes"] / d["max_bytes"], 1 - d["deadline_s"] / (args.minutes * 60) if args.minutes else 0.0)
            status = (f"{d['corpus_tokens']:,} tokens, {d['bytes'] / 1e6:.2f}/{args.max_mb:g} MB, {d['tok_s']:.0f} tok/s, "
                      f"{d['answers']} answers this run, ETA {_eta(eta)}" + (f" (finishing: {d['stop']})" if d["stop"] else ""))
            bar.update(task, completed=min(done, 1.0), status=status)
            if not err.is_terminal and time.monotonic() - last_log[0] >= 60:  # a log instead of a terminal: a line a minute
                last_log[0] = time.monotonic()
                err.print(time.strftime("%H:%M:%S ") + status, highlight=False)

        report = corpus.grow(model, folder, cfg, minutes=args.minutes, max_bytes=max_bytes, progress=progress, on_skip=on_skip)
    why = {
        "max-mb": f"the size budget is reached ({report.bytes_on_disk / 1e6:.2f} MB of --max-mb {args.max_mb:g}): "
        "raise --max-mb to grow it further",
        "minutes": f"--minutes {args.minutes or 0:g} passed",
        "prompts": "every prompt of the training mix is answered",
        "interrupted": "interrupted: the finished answers are kept, the ones under way dropped; run it again to go on",
    }.get(report.stop, report.stop)
    rate = report.generated / report.seconds if report.seconds else 0.0
    err.print(f"{why}\nthis run: {report.answers} answers, {report.tokens:,} tokens in {len(report.shards)} shards "
              f"({rate:.0f} tok/s over {report.seconds / 60:.1f} min); the corpus: {report.corpus_tokens:,} tokens, "
              f"{report.bytes_on_disk / 1e6:.2f} MB in {folder}", highlight=False)
    if report.signum:
        raise interrupt_for(report.signum)
    return 0


def cmd_corpus_info(args: argparse.Namespace) -> int:
    if args.model is not None:
        model, folder = _corpus_model(args.model)
        targets = [(args.corpus or folder, model)]
    elif args.corpus is not None:
        targets = [(args.corpus, None)]
    else:
        root = corpus.corpus_root()
        folders = sorted(d for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
        # a registry model's corpus is checked against the model where it is downloaded
        targets = [(d, _corpus_model(d.name)[0] if d.name in known_models() else None) for d in folders]
        if not targets:
            raise EesdError(f"no corpus in {root}", hint="grow one: eesd heads corpus grow --model MODEL")
    reports = []
    for folder, model in targets:
        if not folder.is_dir():
            raise EesdError(f"no corpus at {folder}", hint="grow one: eesd heads corpus grow --model MODEL")
        stamp = corpus.ModelStamp.of(model) if model is not None else None
        c = corpus.read_corpus(folder, model=stamp, on_skip=lambda p, why: None)  # listed below, under "skipped"
        st = c.stats()
        st["fingerprint_checked"] = stamp is not None
        reports.append(st)
    if args.json:
        print(json.dumps(reports, indent=1))
        return 0
    for st in reports:
        bpt = st["bytes"] / st["tokens"] if st["tokens"] else 0.0
        print(st["folder"])
        for label in st["models"]:
            print(f"  model     {label}" + ("" if st["fingerprint_checked"] else " (not checked against a model file)"))
        print(f"  shards    {st['shards']}" + (f", {len(st['skipped'])} skipped" if st["skipped"] else ""))
        print(f"  answers   {st['answers']:,} ({st['finished']:,} ended by the model, the rest cut at max_new)"
              + (f", {st['duplicates']} duplicates ignored" if st["duplicates"] else ""))
        print(f"  tokens    {st['tokens']:,} answer tokens (their prompts: {st['prompt_tokens']:,} tokens, rebuilt, not stored)")
        print(f"  bytes     {st['bytes']:,} ({bpt:.3f} bytes per token: {bpt:.2f} MB per 1M tokens)")
        print("  prompts   " + ", ".join(f"{k} {v:,}" for k, v in sorted(st["sources"].items())))
        for s in st["settings"]:
            print("  settings  " + ", ".join(f"{k} {v}" for k, v in s.items()))
        for line in st["skipped"]:
            print(f"  skipped   {line}")
    return 0
