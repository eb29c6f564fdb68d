"""Command lines: absl / ml_collections flags with one-line errors, and a generated ``--help``.

    parse_command_line(sys.argv, command, define_flags) -> the remaining argv

``--help`` (or ``-h``, ``--helpfull``, ``--helpshort``) prints what the command does, the
config files it accepts, how to override a field, every config field with its value and
meaning, and examples, then exits 0. The meanings are ``config.FIELD_DOCS`` (or the command's
own table, for ``sft``), so help cannot drift from the code. absl's own help flags are defined
only by ``absl.app``, which these commands do not use. ``startup_done(command)`` marks where a
command's start-up ends; with ``ARLOPTI_STARTUP_CHECK=1`` the command stops there.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import ml_collections

from arlopti_jax.runtime.startup import STARTUP_CHECK_ENV, startup_done  # noqa: F401  (re-exported)
from arlopti_jax.config import DEFAULT_CONFIG, FIELD_DOCS, base_config, choices, field_paths, load_config_file

HELP_FLAGS = ("-h", "--help", "--helpfull", "--helpshort")
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"  # present in a source checkout


@dataclasses.dataclass(frozen=True)
class Command:
    """What ``--help`` says about one command line.

    name           the module (``arlopti_jax.train``)
    doc            what it does (its module docstring)
    examples       command lines, each optionally followed by '  # comment'
    default_file   the config file used without ``--config=`` (train, eval); None when the
                   config is ``default_config()`` itself (sft)
    default_config the config without a file (sft); for file-based commands, the base config
                   whose values are shown beside any that a file changes
    docs           field -> meaning
    flags          other flags: (flag, meaning)
    """

    name: str
    doc: str
    examples: tuple[str, ...]
    default_file: str | None = None
    default_config: Callable[[], ml_collections.ConfigDict] = base_config
    docs: dict[str, str] = dataclasses.field(default_factory=lambda: FIELD_DOCS)
    flags: tuple[tuple[str, str], ...] = ()


def _file_spec(argv: list[str], default_file: str | None) -> str | None:
    return next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), default_file)


def _load(argv: list[str], command: Command) -> ml_collections.ConfigDict | None:
    """The config the command line names (without overrides), or None if it cannot be loaded."""
    spec = _file_spec(argv, command.default_file)
    if spec is None:
        return command.default_config()
    path, _, arg = spec.partition(":")
    try:
        return load_config_file(path, arg)
    except Exception:
        return None


def _show(value) -> str:
    if isinstance(value, str):
        return f'"{value}"' if value == "" else value
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def _config_files() -> list[str]:
    if not CONFIGS_DIR.is_dir():
        return ["  (the configs/ folder of a source checkout; any Python file with get_config())"]
    lines = []
    for path in sorted(CONFIGS_DIR.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines.append(f"  {str(path.relative_to(CONFIGS_DIR.parent)):<28}{doc.strip().splitlines()[0] if doc else ''}")
    return lines


def help_text(command: Command, argv: list[str]) -> str:
    config = _load(argv, command)
    wrap = lambda text, indent: textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent,
                                              break_on_hyphens=False)  # names like seq-mean-token-mean stay whole
    usage_file = "" if command.default_file is None else " [--config=FILE[:ARG]]"
    program = command.name if command.name.endswith(".py") else f"-m {command.name}"  # a script, or a module
    out = [f"usage: python {program}{usage_file} [--config.GROUP.FIELD=VALUE ...]"
           + "".join(f" [{flag.split('=')[0]}=...]" for flag, _ in command.flags), "", command.doc.strip(), ""]
    if command.default_file is not None:
        out += [wrap("Config files (--config=FILE[:ARG]; ARG is passed to the file's get_config). Without "
                     "--config: arlopti_jax/embedded/default.py, the embedded default (its numerics follow this "
                     "machine's backend: the values below are this machine's).", ""), *_config_files(), ""]
    example = ("--config.train.max_steps=10, --config.algo.filter_groups=True, --config.train.eval_ks=1,4,8 "
               "(a tuple)" if command.default_file is not None else "--config.train.steps=100, --config.tiny=True")
    out += [wrap(f"Overriding a field: --config.GROUP.FIELD=VALUE, e.g. {example}. An unknown field or an invalid "
                 "value stops the command at start-up with one line naming it.", ""), ""]
    for flag, meaning in command.flags:
        out += [f"  {flag}", wrap(meaning, "      ")]
    if command.flags:
        out.append("")
    spec = _file_spec(argv, command.default_file)
    if config is None:
        out += [f"Config fields (the config file {spec} could not be loaded; the base defaults):"]
        config = command.default_config()
        base = None
    elif spec is None:
        out += ["Config fields, with their defaults:"]
        base = None
    else:
        shown = "the embedded default" if spec == command.default_file else spec
        out += [f"Config fields, with their values in {shown} ([base: X] where the base default differs):"]
        base = command.default_config()
    order = {name: i for i, name in enumerate(command.docs)}
    allowed = choices() if command.docs is FIELD_DOCS else {}  # the registries' values, listed as validated
    base_fields = set(field_paths(base)) if base is not None else set()
    for name in sorted(field_paths(config), key=lambda n: (order.get(n, len(order)), n)):
        value = _show(_get(config, name))
        note = ""
        if name in base_fields and _show(_get(base, name)) != value:
            note = f"   [base: {_show(_get(base, name))}]"
        meaning = command.docs.get(name, "(undocumented)")
        if name in allowed:
            meaning += f" [allowed: {', '.join(allowed[name])}]"
        out += [f"  {name} = {value}{note}", wrap(meaning, "      ")]
    out += ["", "Examples:", *(f"  {line}" for line in command.examples)]
    return "\n".join(out)


def _get(config: ml_collections.ConfigDict, name: str):
    for part in name.split("."):
        config = config[part]
    return config


def config_table(docs: dict[str, str] = FIELD_DOCS) -> str:
    """The README's config table: every field of ``base_config()``, its default and meaning."""
    base = base_config()
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for name in docs:
        value = _show(_get(base, name))
        rows.append(f"| `{name}` | {'`' + value + '`' if isinstance(_get(base, name), str) else value} "
                    f"| {docs[name].replace('|', chr(92) + '|')} |")  # a bare | would end the cell
    return "\n".join(rows)


def define_config_file() -> None:
    """The ``--config=FILE[:ARG]`` flag of the commands that read a config file (train, eval, aot);
    without it, the embedded default. Overrides are ``--config.GROUP.FIELD=VALUE``; the config is
    locked (a new field is an error)."""
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Python config file (see configs/).", lock_config=True)


def parse_command_line(argv: list[str], command: Command, define_flags) -> list[str]:
    """``--help``: print ``help_text`` and exit 0. Otherwise define (``define_flags()``) and parse
    the absl flags (``--config=FILE --config.a.b=v``); on a bad flag print one line naming it and
    exit with status 2. Then turns on JAX's persistent compilation cache in the config's
    ``compile_cache_dir`` (``compile_cache.enable``). Returns the remaining argv."""
    from absl import flags

    if any(arg in HELP_FLAGS for arg in argv[1:]):
        try:
            print(help_text(command, argv[1:]), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    try:
        define_flags()  # ml_collections' config flags already read sys.argv here
        rest = flags.FLAGS(argv)
        flags.FLAGS.config.keys()  # the config file loads lazily: fail here, not mid-run
        from arlopti_jax.runtime import compile_cache

        compile_cache.enable(flags.FLAGS.config.get("compile_cache_dir", ""))  # before anything compiles
        return rest
    except Exception as err:  # absl/ml_collections raise several types for bad overrides
        root = err
        while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
            root = root.__cause__ or root.__context__  # `raise ... from None` ends the chain
        last_line = lambda e: str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        message = last_line(err)
        if isinstance(root, OSError):
            message = f"cannot load the config file: {last_line(root)}"
        base = _load(argv[1:], command)
        if base is not None:
            known = field_paths(base)
            for arg in argv[1:]:
                if not arg.startswith("--config."):
                    continue
                field = arg[len("--config."):].split("=", 1)[0]
                if field not in known:
                    close = difflib.get_close_matches(field, known, n=1)
                    hint = f"; did you mean config.{close[0]}?" if close else ""
                    message = f"config.{field} is not a config field{hint}"
                    break
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
