"""torchrun's command-line grammar, explicitly: ``[options] SCRIPT [script args...]``.

- options come first, in any order, as ``--opt VALUE``, ``--opt=VALUE``, ``-r3``, ``-r=3``, with
  both spellings torchrun accepts (``--nproc-per-node``, ``--nproc_per_node``) and unique
  prefixes (``--nproc``), as argparse allows;
- the first word that is not an option (or the word after ``--``) is the script; everything
  after it goes to the script untouched, even words that look like options;
- ``-h``/``--help`` anywhere before the script asks for help;
- a torchrun option that is absent from the command line is read from ``PET_<DEST>``
  (``PET_NPROC_PER_NODE``), then from elasticrun's own variable if it has one: a flag beats
  the environment, as in torchrun.

The result, :class:`Parsed`, holds typed values plus where each one came from (so that an
error can name the flag or the variable). Unknown options are "unknown option --foo".
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from elasticrun.cli.run_options import Kind, Opt, Type, all_options, by_name
from elasticrun.errors import ConfigError

_NUMBER = re.compile(r"^-\d+(\.\d*)?$|^-\.\d+$")


@dataclass
class Parsed:
    """What the command line and the environment said."""

    values: Dict[str, Any] = field(default_factory=dict)  # dest → typed value (defaults included)
    sources: Dict[str, str] = field(default_factory=dict)  # dest → "--flag" or "PET_X" for explicit values
    script: str = ""
    script_args: List[str] = field(default_factory=list)
    help: bool = False
    env: Mapping[str, str] = field(default_factory=dict)  # the environment the values were read from
    texts: Dict[str, str] = field(default_factory=dict)  # dest → the explicit value as written

    def given(self, dest: str) -> bool:
        """True when ``dest`` was set on the command line or from the environment."""
        return dest in self.sources

    def where(self, dest: str) -> str:
        """How to name ``dest`` in a message: the flag used, or ``PET_X=value``."""
        src = self.sources.get(dest, "")
        if src and not src.startswith("-"):
            return src if "password" in dest else f"{src}={self.env.get(src, '')!r}"  # never echo a secret
        return src or "--" + dest.replace("_", "-")

    def shown(self, dest: str) -> str:
        """``dest`` with its value as the user wrote it, for a message: ``--nnodes 'x'`` or ``PET_NNODES='x'``."""
        text = self.texts.get(dest, str(self.values.get(dest) or ""))
        return _shown(self.sources.get(dest) or "--" + dest.replace("_", "-"), text, secret="password" in dest)


class Parser:
    """Parses ``elasticrun run`` arguments with one option table (see :mod:`run_options`)."""

    def __init__(self, options: Optional[Tuple[Opt, ...]] = None) -> None:
        self.options = options if options is not None else all_options()
        self._names = by_name(self.options)

    # -- public ---------------------------------------------------------------------------

    def parse(self, argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> Parsed:
        """Parse ``argv`` (without the program name); raise ConfigError for bad input."""
        env = os.environ if environ is None else environ
        out = Parsed(env=env)
        raw: Dict[str, Tuple[str, Any]] = {}  # dest → (source, raw value)
        words = list(argv)
        i = 0
        while i < len(words):
            word = words[i]
            if word == "--":
                if i + 1 < len(words):
                    out.script, out.script_args = words[i + 1], words[i + 2:]
                break
            if word in ("-h", "--help"):
                out.help = True
                i += 1
                continue
            if not word.startswith("-") or word == "-" or _NUMBER.match(word):
                out.script, out.script_args = word, words[i + 1:]
                break
            i = self._option(words, i, raw)
        if out.help:
            return out
        self._environment(env, raw)
        for opt in self.options:
            if opt.dest in raw:
                source, value = raw[opt.dest]
                out.sources[opt.dest] = source
                out.texts[opt.dest] = str(value)
                out.values[opt.dest] = _convert(opt, value, _shown(source, str(value), "password" in opt.dest))
            else:
                out.values[opt.dest] = opt.default
        return out

    # -- command line -----------------------------------------------------------------------

    def _option(self, words: List[str], i: int, raw: Dict[str, Tuple[str, Any]]) -> int:
        """Consume the option at ``words[i]``; return the index of the next word."""
        word = words[i]
        if word.startswith("--"):
            name, eq, attached = word.partition("=")
            opt, value, spelled = self._lookup_long(name)
            if opt.kind is Kind.FLAG:
                if eq:
                    raise ConfigError(f"option {spelled} takes no value (got {word!r})")
                raw[opt.dest] = (spelled, value)
                return i + 1
            if eq:
                raw[opt.dest] = (spelled, attached)
                return i + 1
            return self._take_value(words, i, opt, spelled, raw)
        return self._short(words, i, raw)

    def _short(self, words: List[str], i: int, raw: Dict[str, Tuple[str, Any]]) -> int:
        """``-m``, ``-r 3``, ``-r3``, ``-r=3``, ``-mq`` (flags combined)."""
        word = words[i]
        rest = word[1:]
        while rest:
            name = "-" + rest[0]
            rest = rest[1:]
            if name in ("-h",):
                raise ConfigError("-h cannot be combined with other options; use -h on its own")
            entry = self._names.get(name)
            if entry is None:
                raise ConfigError(f"unknown option {name if not rest else word}; see `elasticrun --help` "
                                  "(elasticrun options go before the script)")
            opt, flag_value = entry
            if opt.kind is Kind.FLAG:
                raw[opt.dest] = (name, flag_value)
                continue
            if rest:
                raw[opt.dest] = (name, rest[1:] if rest.startswith("=") else rest)
                return i + 1
            return self._take_value(words, i, opt, name, raw)
        return i + 1

    def _take_value(self, words: List[str], i: int, opt: Opt, spelled: str, raw: Dict[str, Tuple[str, Any]]) -> int:
        if i + 1 >= len(words) or (words[i + 1].startswith("-") and not _NUMBER.match(words[i + 1])):
            hint = f" {opt.metavar}" if opt.metavar else " VALUE"
            raise ConfigError(f"option {spelled} needs a value: {spelled}{hint}")
        raw[opt.dest] = (spelled, words[i + 1])
        return i + 2

    def _lookup_long(self, name: str) -> Tuple[Opt, Any, str]:
        """(option, flag value, the full spelling) for ``--name`` or a unique prefix of one."""
        entry = self._names.get(name)
        if entry is not None:
            return entry[0], entry[1], name
        matches = {n: e for n, e in self._names.items() if n.startswith("--") and n.startswith(name)}
        targets = {(e[0].dest, e[1]) for e in matches.values()}
        if len(targets) == 1 and len(name) > 3:
            full = sorted(matches)[0]
            opt, value = matches[full]
            return opt, value, opt.long if value is True or opt.kind is Kind.VALUE else full
        if len(targets) > 1:
            names = ", ".join(sorted({e[0].long if e[1] is True else n for n, e in matches.items()}))
            raise ConfigError(f"ambiguous option {name}: could be {names}")
        raise ConfigError(f"unknown option {name}; see `elasticrun --help` (elasticrun options go before the script)")

    # -- environment ------------------------------------------------------------------------

    def _environment(self, env: Mapping[str, str], raw: Dict[str, Tuple[str, Any]]) -> None:
        """Fill options absent from the command line from PET_<DEST>, then elasticrun's variables."""
        for opt in self.options:
            if opt.dest in raw:
                continue
            for var in ((opt.pet,) if opt.pet else ()) + opt.envvars:
                if var in env:
                    value: Any = env[var]
                    if opt.kind is Kind.FLAG:
                        value = _env_flag(var, env[var])
                    raw[opt.dest] = (var, value)
                    break


def _env_flag(var: str, text: str) -> bool:
    """torchrun's ``check_env``: an integer, non-zero means on; empty means on, as Kubeflow's
    PyTorchJob sets ``PET_STANDALONE=""`` for ``elasticPolicy.standalone: true``."""
    if not text.strip():
        return True
    try:
        return int(text.strip()) != 0
    except ValueError:
        raise ConfigError(f"{var}={text!r}: use 1 (on) or 0 (off)") from None


def _shown(source: str, text: str, secret: bool = False) -> str:
    """A flag or variable with its value, as a message names it: ``--port '70000'``, ``PET_NNODES='x'``."""
    if secret:
        return source
    return f"{source} {text!r}" if source.startswith("-") else f"{source}={text!r}"


def _number(opt: Opt, text: str, where: str) -> Any:
    """``text`` as the option's INT or FLOAT, within its range; one line naming ``where`` otherwise."""
    kind = "a whole number" if opt.type is Type.INT else "a number of seconds"
    try:
        number: Any = int(text) if opt.type is Type.INT else float(text)
    except ValueError:
        raise ConfigError(f"{where}: expected {kind}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{where}: expected a finite number of seconds")
    note = f" ({opt.range_note})" if opt.range_note else ""
    if opt.at_least is not None and number < opt.at_least:
        high = f" .. {opt.at_most:g}" if opt.at_most is not None else " or more"
        raise ConfigError(f"{where}: must be {opt.at_least:g}{high}{note}")
    if opt.more_than is not None and number <= opt.more_than:
        raise ConfigError(f"{where}: must be more than {opt.more_than:g}{note}")
    if opt.at_most is not None and number > opt.at_most:
        low = f"{opt.at_least:g} .. " if opt.at_least is not None else "at most "
        raise ConfigError(f"{where}: must be {low}{opt.at_most:g}{note}")
    return number


def _convert(opt: Opt, value: Any, where: str) -> Any:
    """Check the type, range and choices of one explicit value; ``where`` names its flag or variable."""
    if opt.kind is Kind.FLAG:
        return bool(value)
    text = str(value).strip()
    if opt.type in (Type.INT, Type.FLOAT):
        return _number(opt, text, where)
    if opt.choices and text not in opt.choices:
        raise ConfigError(f"{where}: choose one of {', '.join(opt.choices)}")
    return value


def parse(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> Parsed:
    """Parse ``elasticrun run`` arguments with every option (see :class:`Parser`)."""
    return Parser().parse(argv, environ)
