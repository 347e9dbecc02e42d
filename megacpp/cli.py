"""megacpp command line: one entry point, subcommands, presets, TOML configs and --section.key overrides.

The parser and `--help` load no torch: what this module imports at the top is torch-free (argparse, the
preset names, the compile choices), and everything else is imported by the command that runs. Reading
the configuration (`megacpp.run_config`) loads no torch either, so `megacpp config` answers without it.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import math
import os
import re
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megacpp.compile.config import BACKENDS, MODES
from megacpp.errors import ConfigError, Interrupted, MegacppError, UsageError
from megacpp.presets import PRESETS
from megacpp.rules import SEED_MAX

if TYPE_CHECKING:
    from megacpp.config import Config

EPILOG_CONFIG = """\
configuration:
  Three layers, each overriding the one before: preset < config file < command line.
  The preset is --preset or the file's `preset = "..."` (two different names are an error); with
  neither, a --config file starts from the built-in defaults and no file means --preset tiny.
  Override any field with --section.key VALUE, e.g.
      megacpp train --model.depth 12 --train.steps 2000 --optim.muon_lr 0.02
  The merged configuration is checked once, before any data work; an error names the key and where
  its value came from (file:line, --key, the preset). `megacpp config --preset small` prints every
  key with its value.
"""


EPILOG_TRAIN = """\
GPU memory (out-of-memory auto-fit):
  On CUDA, with train.oom_autofit = true (the default), the training runs as a child process. If it
  runs out of GPU memory in its first 3 steps it is started again with half the micro-batch and
  twice the accumulation (train.micro_batch: rows per forward/backward, a divisor of
  train.batch_size), so the global batch, the token stream and the learning-rate schedule do not
  change; down to train.oom_min_micro_batch (default 1), then it stops with one line naming the
  smallest micro-batch tried and the peak memory. Under torchrun all ranks retry together. Each
  attempt's output is also kept in <out_dir>/logs/attempt<N>.log; the chosen micro-batch is recorded
  in the checkpoints and --resume keeps it. --train.oom_autofit false turns it off; it is off on CPU.
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="named preset to start from (default: the file's preset, else tiny)")
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML config file (may set preset = ..., the same one)")


def _split_overrides(rest: Sequence[str]) -> list[tuple[str, str]]:
    """Turn ['--model.depth', '8', '--train.seed=3'] into [('model.depth', '8'), ('train.seed', '3')]."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"command line: unexpected argument {arg!r} (overrides look like --model.depth 8)")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(rest):
            value = rest[i + 1]
            i += 2
        else:
            raise ConfigError(f"command line: --{key} needs a value")
        out.append((key, value))
    return out


def build_config(args: argparse.Namespace, rest: Sequence[str]) -> Config:
    from megacpp.run_config import load_config

    overrides = _split_overrides(rest)
    args.override_keys = [key for key, _ in overrides]
    cfg, _sources = load_config(args.preset, args.config, overrides)
    return cfg


# What `eval` and `sample` take from the command line's configuration: where the checkpoint is and which
# device runs it. Model, data and tokenizer are the checkpoint's own (its meta.json and tokenizer.json).
CHECKPOINT_COMMAND_KEYS = ("train.out_dir", "train.device")


def _check_checkpoint_overrides(command: str, args: argparse.Namespace) -> None:
    """Refuse overrides a checkpoint command would silently ignore (e.g. --data.corpus on eval)."""
    ignored = [key for key in getattr(args, "override_keys", []) if key not in CHECKPOINT_COMMAND_KEYS]
    if ignored:
        raise UsageError(f"{command}: --{ignored[0]} is not used: {command} rebuilds the model, data and "
                         "tokenizer from the checkpoint's own config (its meta.json); only "
                         f"{', '.join('--' + k for k in CHECKPOINT_COMMAND_KEYS)} apply")


# ---------------------------------------------------------------- subcommands


def cmd_train(args: argparse.Namespace, cfg: Config) -> int:
    from megacpp.train.autofit.supervisor import supervise, wants_supervisor

    if wants_supervisor(cfg):  # CUDA: the training runs (and re-runs, after a warmup OOM) as a child
        return supervise(cfg, args.argv, args.resume)
    from megacpp.train.autofit.attempt import attempt_from_env
    from megacpp.train.loop import train
    from megacpp.train.report import run_summary

    result = train(cfg, resume=args.resume, progress=not args.no_progress, attempt=attempt_from_env())
    if result.rank == 0 and result.evaluation is not None:  # None: nothing was trained (already said why)
        print(run_summary(result))
    return 0


def _check_eval_args(args: argparse.Namespace) -> None:
    if args.batches < 0:
        raise UsageError(f"--batches {args.batches}: must be >= 0 (0 = the whole validation split)")
    if args.out is not None and not args.by_position:
        raise UsageError(f"--out {args.out}: only --by-position writes a file (add --by-position)")
    if args.context_window is not None:
        if not args.by_position:
            raise UsageError(f"--context-window {args.context_window}: it cuts the context of --by-position's curve "
                             "(add --by-position)")
        if args.context_window < 1:
            raise UsageError(f"--context-window {args.context_window}: must be >= 1 token")
    if args.cpp_syntax < 0:
        raise UsageError(f"--cpp-syntax {args.cpp_syntax}: must be >= 0 (the number of functions; 0 = off)")
    if args.cpp_tokens is not None and args.cpp_tokens < 1:
        raise UsageError(f"--cpp-tokens {args.cpp_tokens}: must be >= 1")
    if args.cpp_context is not None and args.cpp_context < 1:
        raise UsageError(f"--cpp-context {args.cpp_context}: must be >= 1")
    if not (math.isfinite(args.cpp_timeout) and args.cpp_timeout > 0):
        raise UsageError(f"--cpp-timeout {args.cpp_timeout}: must be a finite number of seconds > 0")


def _cpp_tokens(args: argparse.Namespace, seq_len: int) -> int:
    """The completion budget: --cpp-tokens, else half the training row (at most the default budget); the
    prompt gets the rest of the row, so the budget must leave it at least one token."""
    from megacpp.runtime.cpp_syntax import DEFAULT_TOKENS

    if args.cpp_tokens is None:
        return min(DEFAULT_TOKENS, seq_len // 2)
    if args.cpp_tokens >= seq_len:
        raise UsageError(f"--cpp-tokens {args.cpp_tokens}: must be below the checkpoint's data.seq_len {seq_len} "
                         "(the prompt gets the rest of the row)")
    return args.cpp_tokens


def _check_sample_args(args: argparse.Namespace) -> None:
    """Ranges and the prompt's text, before the checkpoint is loaded."""
    if args.tokens < 1:
        raise UsageError(f"--tokens {args.tokens}: must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature {args.temperature}: must be a finite number >= 0 (0 = greedy)")
    if args.top_k < 0:
        raise UsageError(f"--top-k {args.top_k}: must be >= 0 (0 = all tokens)")
    if not 0 <= args.seed <= SEED_MAX:
        raise UsageError(f"--seed {args.seed}: must be in [0, {SEED_MAX}] (an unsigned 64-bit seed)")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes that are not UTF-8 reach argv as lone surrogates
        raise UsageError(f"--prompt is not valid UTF-8 text: character {exc.start} "
                         f"({exc.object[exc.start]!r}) is an undecodable byte or a lone surrogate") from exc


def cmd_eval(args: argparse.Namespace, cfg: Config) -> int:
    from megacpp.infer.session import load_session
    from megacpp.train.report import eval_summary

    _check_eval_args(args)
    _check_checkpoint_overrides("eval", args)
    compiler = None
    if args.cpp_syntax:  # before any loading: a missing compiler is one line at once
        from megacpp.runtime.cpp_syntax import find_compiler

        compiler = find_compiler()
    session = load_session(args.checkpoint or cfg.train.out_dir, cfg)
    cpp_tokens = _cpp_tokens(args, session.config.data.seq_len) if compiler is not None else 0
    cpp_context = args.cpp_context or session.config.data.seq_len - cpp_tokens
    evaluation, baselines = session.evaluate(args.batches)
    print(eval_summary(evaluation, baselines, session.checkpoint))
    if (changed := session.data_changed()) is not None:
        print(changed)
    if args.by_position:
        from megacpp.runtime.position_curve import default_curve_path

        curve = session.position_curve(args.batches, args.context_window)
        path = args.out or default_curve_path(session.checkpoint, args.context_window)
        curve.write(path)
        print(f"{curve.table()}\nwrote {path}")
    if compiler is not None:
        print(session.cpp_syntax(args.cpp_syntax, compiler, cpp_tokens, cpp_context, args.cpp_timeout).summary())
    return 0


def cmd_sample(args: argparse.Namespace, cfg: Config) -> int:
    from megacpp.infer.session import load_session

    _check_sample_args(args)
    _check_checkpoint_overrides("sample", args)
    session = load_session(args.checkpoint or cfg.train.out_dir, cfg)
    if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors == "strict":
        # A stdout that cannot encode a sampled character (PYTHONIOENCODING=ascii, a C locale) shows it
        # escaped, \xe9, instead of ending the sample with a UnicodeEncodeError.
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        for piece in session.stream(args.prompt, args.tokens, args.temperature, args.top_k, args.seed):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`megacpp sample | head -c 100`): stop quietly, as a shell tool that
        # SIGPIPE ends does; stdout points at /dev/null so that the exit's own flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return 0


def cmd_tokenizer_train(args: argparse.Namespace, cfg: Config) -> int:
    from megacpp.runtime.data import train_tokenizer_cli

    print(train_tokenizer_cli(cfg.data, args.out))
    return 0


def cmd_data_prepare(args: argparse.Namespace, cfg: Config) -> int:
    from megacpp.runtime.data import build_data

    data = build_data(cfg.data, cfg.train.seed, cfg.train.batch_size, "cpu", print)
    print(data.baselines.summary())
    print(f"ready: tokenizer {data.tokenizer_hash[:12]}, shards at {data.shards.dir}")
    return 0


def cmd_doctor(args: argparse.Namespace, cfg: Config) -> int:
    from megacpp import environment
    from megacpp.doctor import doctor_report

    if args.freeze is not None:
        record = environment.write_freeze(args.freeze)
        print(f"wrote {args.freeze}: {len(record['packages'])} packages, torch {record['torch']}, "
              f"megacpp {record['megacpp']}")
        return 0
    if args.check is not None:
        differences = environment.compare(environment.read_freeze(args.check), environment.freeze())
        for line in differences:
            print(line)
        print(f"{len(differences)} difference(s) from {args.check}" if differences
              else f"same environment as {args.check}")
        return 1 if differences else 0
    print(doctor_report(cfg))
    return 0


def cmd_params(args: argparse.Namespace, cfg: Config) -> int:
    import torch

    from megacpp.model.hybrid import HybridLM
    from megacpp.model.params import parameter_table

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=cfg.data.vocab_size))
    with torch.device("meta"):  # counts need shapes only: even nam52 costs no memory
        model = HybridLM(cfg.model)
    print(f"{cfg.model.pattern} tiled to {cfg.model.depth}: {model.layout}")
    print(parameter_table(model))
    return 0


def cmd_config(args: argparse.Namespace, cfg: Config) -> int:
    from megacpp.config import dump_toml

    print(dump_toml(cfg), end="")
    return 0


def cmd_compile_report(args: argparse.Namespace, cfg: Config) -> int:
    from megacpp.compile.cli import compile_report_cli

    print(compile_report_cli(cfg, backend=args.backend, mode=args.mode, device=args.device))
    return 0


def cmd_cache(args: argparse.Namespace, cfg: Config) -> int:
    from megacpp.compile.cli import cache_cli

    print(cache_cli(args.action, args.path))
    return 0


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megacpp",
        description="Train hybrid attention / Mamba-3 / MoE / recurrent language models for code.",
        epilog="Run `megacpp train` to train the tiny preset on the C++ headers shipped with torch.\n\n"
        + EPILOG_CONFIG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help_text: str, config: bool = True, epilog: str = "") -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text,
                           epilog=epilog + EPILOG_CONFIG if config else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if config:
            _add_config_args(p)
        p.set_defaults(func=func)
        return p

    p = add("train", cmd_train, "train a model (default: the tiny preset on torch's C++ headers, on CPU)",
            epilog=EPILOG_TRAIN + "\n")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in out_dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")

    p = add("eval", cmd_eval, "bits per byte of a checkpoint on the validation split")
    p.add_argument("--checkpoint", type=Path, help="checkpoint or run directory (default: train.out_dir)")
    p.add_argument("--batches", type=int, default=0,
                   help="validation batches to evaluate, each the run's optimizer step's rows, as training's "
                        "train.eval_batches (default 0: the whole split, the text the baselines cover)")
    p.add_argument("--by-position", action="store_true",
                   help="also bits/byte by position in the document (1-64, 65-128, ... tokens of context): "
                   "a table, and JSON written to --out or RUN/position_curve-<checkpoint>.json")
    p.add_argument("--context-window", type=int, metavar="W",
                   help="with --by-position: the model reads each document in windows of W tokens (each a document "
                   "of its own), positions still counted in the document; against the full curve, what context "
                   "past W tokens is worth (JSON: RUN/position_curve-<checkpoint>-windowW.json)")
    p.add_argument("--out", type=Path, metavar="FILE", help="where --by-position writes its JSON")
    p.add_argument("--cpp-syntax", type=int, default=0, metavar="N",
                   help="also complete N held-out C++ functions of the validation split greedily and check each "
                   "file with the C++ compiler ($CXX, else g++/clang++/c++) in syntax-only mode (default 0: off)")
    p.add_argument("--cpp-tokens", type=int, metavar="T",
                   help="token budget of each --cpp-syntax completion (default: half of data.seq_len, at most 512)")
    p.add_argument("--cpp-context", type=int, metavar="T",
                   help="prompt tokens of each --cpp-syntax case (default: the rest of the training row); a shorter "
                   "prompt reads faster and gives the model less to go on")
    p.add_argument("--cpp-timeout", type=float, default=60.0, metavar="S",
                   help="seconds allowed to each compiler call of --cpp-syntax (default 60)")

    p = add("sample", cmd_sample, "stream generated text from a checkpoint")
    p.add_argument("--checkpoint", type=Path, help="checkpoint or run directory (default: train.out_dir)")
    p.add_argument("--prompt", default="#include <", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="new tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="same seed, prompt and settings give the same text")

    tok = sub.add_parser("tokenizer", help="tokenizer tools").add_subparsers(dest="action", required=True)
    p = tok.add_parser("train", help="train the byte-level BPE tokenizer on the corpus", epilog=EPILOG_CONFIG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.add_argument("--out", type=Path, help="directory for tokenizer.json, or a .json file path; an existing "
                   "different file is never replaced (default: the data cache only)")
    p.set_defaults(func=cmd_tokenizer_train)

    data = sub.add_parser("data", help="data tools").add_subparsers(dest="action", required=True)
    p = data.add_parser("prepare", help="discover, tokenize and cache the corpus shards", epilog=EPILOG_CONFIG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.set_defaults(func=cmd_data_prepare)

    p = add("doctor", cmd_doctor, "versions, devices, caches, kernels, an ABI audit of compiled extensions, the "
            "distributed environment and the determinism promise table")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--freeze", type=Path, metavar="FILE",
                       help="write the exact environment (versions, GPUs, driver, every package, megacpp's commit); "
                       "replaces only an earlier record")
    group.add_argument("--check", type=Path, metavar="FILE",
                       help="compare this environment with a --freeze record: every difference, exit 1 if any")
    add("params", cmd_params, "parameter table per block kind (total and active)")
    add("config", cmd_config, "print the resolved configuration as TOML")

    p = add("compile-report", cmd_compile_report, "per-callsite torch.compile table: graphs, breaks, recompiles")
    p.add_argument("--backend", choices=BACKENDS, default="eager")
    p.add_argument("--mode", choices=[m for m in MODES if m != "none"], default="blocks")
    p.add_argument("--device", default="auto")

    p = add("cache", cmd_cache, "export or import the warm torch.compile cache", config=False)
    p.add_argument("action", choices=["export", "import"])
    p.add_argument("path", type=Path, help="archive directory to export to or import from")
    return parser


def _fail(message: str, code: int) -> int:
    print(f"megacpp: {message}", file=sys.stderr)
    return code


def _describe_os_error(exc: OSError) -> str:
    """``strerror: filename`` as the shell says it; the path is the part a user can act on."""
    if exc.filename is None:
        return exc.strerror or str(exc)
    names = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else str(exc.filename)
    return f"{exc.strerror or exc}: {names}"


def _out_of_memory(exc: RuntimeError) -> str | None:
    """One line for an allocator's out-of-memory error, or None for any other RuntimeError (a bug). On the
    host it is a plain RuntimeError naming torch's DefaultCPUAllocator; on a GPU torch.OutOfMemoryError
    (matched by name: the CLI does not import torch)."""
    text = str(exc)
    remedy = ("lower the batch (train.micro_batch), data.seq_len or the model's size, or free memory; "
              "checkpoints already written are intact")
    if "DefaultCPUAllocator: can't allocate memory" in text:
        size = re.search(r"allocate (\d+) bytes", text)
        what = f"could not allocate {int(size.group(1)):,} bytes" if size else "an allocation failed"
        return f"out of host memory: {what} (torch's DefaultCPUAllocator); {remedy}"
    if type(exc).__name__ == "OutOfMemoryError":
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        return f"out of device memory: {first}; {remedy}"
    return None


def _resume_hint(argv: Sequence[str]) -> str:
    """The command that continues an interrupted run."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: this rank cannot see the launch command
        return "continue with: the same torchrun command plus --resume"
    args = [*argv, "--resume"] if "--resume" not in argv else list(argv)
    return f"continue with: megacpp {shlex.join(args)}"


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 on success, 2 on a configuration or argument error, 1 on any other explained error, 130 when
    interrupted (Ctrl-C) and 143 when stopped by SIGTERM (after saving), 141 when `sample`'s reader closes
    the pipe (`| head`), as SIGPIPE would.

    Explained errors (`MegacppError`, the OS refusing a path: unwritable, missing, full disk, and an
    allocator out of memory) print one line. Anything else is a megacpp bug and keeps its traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    args.argv = argv  # what a supervised command runs again in its child
    try:
        if hasattr(args, "preset"):
            cfg = build_config(args, rest)
        else:  # `cache` takes no configuration options
            from megacpp.config import Config

            cfg = Config()
        return args.func(args, cfg)
    except Interrupted as exc:
        return _fail(str(exc) if exc.complete else f"{exc}; {_resume_hint(argv)}", exc.exit_code)
    except KeyboardInterrupt:  # outside the training steps: nothing of this run's was saved just now
        return _fail("interrupted; checkpoints already written are intact", 130)
    except ConfigError as exc:
        return _fail(f"config error: {exc}", 2)
    except UsageError as exc:
        return _fail(f"error: {exc}", 2)
    except MegacppError as exc:
        return _fail(f"error: {exc}", 1)
    except OSError as exc:
        return _fail(f"error: {_describe_os_error(exc)}", 1)
    except RuntimeError as exc:  # out of memory, or under torchrun a peer rank or the job store gone; else a bug
        from megacpp.distributed.failures import describe_failure

        if (line := _out_of_memory(exc) or describe_failure(exc)) is None:
            raise
        return _fail(f"error: {line}", 1)


if __name__ == "__main__":
    sys.exit(main())
