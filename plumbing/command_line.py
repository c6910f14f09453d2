"""The command line every stage shares: one-line errors, flag types that refuse a bad
value where it is parsed.

A stage's `main(args)` raises `UsageError` for anything wrong with the user's input or
files; `run_main` turns it (and a disk that is full or refuses a write, or memory that
runs out) into one line on stderr and exit code 2, never a traceback."""
import argparse
import errno
import math
import re
import signal
import sys

import torch


# expert folders that hold one model of the whole data set, not a cluster's expert
SINGLE_MODELS = ("all", "distilled")
# A contributor's expert is named, not numbered: a letter, then letters, digits, '_', '.',
# '-'.
CONTRIBUTION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")

class UsageError(Exception):
    """A problem with the user's input or files: reported as one line, never as a
    traceback."""

class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is in --help), like every other error
    of the stages."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

class Renamed(argparse.Action):
    """A flag's old name, hidden from --help: giving it is one line that names the new
    one."""

    def __init__(self, option_strings, dest, new, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}")


def stop(signum, frame):
    raise KeyboardInterrupt


def run_main(main, parser):
    """Parse the command line and run main(args): a UsageError, a disk that fills up or
    refuses a write, or memory that runs out, becomes one line on stderr and exit 2 (atomic
    writes leave the previous files as they were)."""
    args = parser.parse_args()
    # SIGTERM (a scheduler's stop, `kill`) takes the same road as Ctrl-C
    signal.signal(signal.SIGTERM, stop)
    try:
        main(args)
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{parser.prog}: stopped; every file it writes is replaced whole or not at "
              "all, so what it finished stands: run the same command again to resume or "
              "redo the rest",
              file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        # numpy's .npy writer on a short write: "N requested and M written"
        if e.errno is None and "requested and" in str(e):
            print(f"{parser.prog}: error: a write was cut short ({e}): is the disk full, "
                  "or a file-size limit (ulimit -f) reached?; nothing was "
                  "replaced", file=sys.stderr)
            sys.exit(2)
        # any refusal of the file system that names its path (a dangling link, a file where a
        # folder must be, EPERM, a full disk...) is the user's to fix: one line
        if e.filename is None and e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS,
                                                  errno.EACCES):
            raise
        print(f"{parser.prog}: error: cannot use {e.filename or 'a file'}: "
              f"{e.strerror or e}; nothing was replaced", file=sys.stderr)
        sys.exit(2)
    # memory the machine does not have for what is held at once: CUDA's allocator raises
    # OutOfMemoryError, numpy MemoryError, torch's CPU allocator a plain RuntimeError
    except (MemoryError, torch.OutOfMemoryError) as e:
        out_of_memory(parser.prog, e)
    # torch.save reports a failed or short write as a RuntimeError of its zip writer;
    # safetensors' I/O errors are its own class
    except RuntimeError as e:
        if "can't allocate memory" in str(e):
            out_of_memory(parser.prog, e)
        if "unexpected pos" not in str(e) and "file write failed" not in str(e):
            raise
        print(f"{parser.prog}: error: a checkpoint write failed: is the disk full, or a "
              "file-size limit (ulimit -f) reached?; nothing was "
              "replaced", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        print(f"{parser.prog}: error: a safetensors file could not be read or written "
              f"({str(e).splitlines()[0] if str(e) else 'no detail'}); nothing was replaced",
              file=sys.stderr)
        sys.exit(2)


def out_of_memory(prog, error):
    """One line and exit 2: a batch (or model) larger than the machine holds is the user's
    to size, and what the command finished stands."""
    print(f"{prog}: error: out of memory ({first_line(error)}): hold less at once (a "
          "smaller --batch-size or model) and run the same command again; every file it "
          "writes is replaced whole, so what it finished stands", file=sys.stderr)
    sys.exit(2)


# --- flag types: a bad value is refused where it is parsed, in one line -------------------------

def int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse

def int_in(low, high):
    """A whole number in [low, high]: the high end bounds what the value drives (an
    allocation, a loop)."""
    at_least = int_at_least(low)

    def parse(text):
        value = at_least(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value
    return parse


def float_in(low=-math.inf, high=math.inf, *, low_open=False, high_open=False):
    """A finite float in the range [low, high] (an end excluded when open)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
        outside = value < low or value > high or (low_open and value == low) \
            or (high_open and value == high)
        if not math.isfinite(value) or outside:
            span = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"must be a finite number in {span}, got {text}")
        return value
    return parse

# numpy's generators take seeds up to here; torch's would take more, but every seed
# reaches both
SEED_MAX = 2 ** 32 - 1


def seed_type(text):
    """A seed: an integer in 0..2^32-1, the range every generator it seeds accepts."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= SEED_MAX or not text.strip().lstrip("+").isascii():
        raise argparse.ArgumentTypeError(f"a seed must be an integer in 0..{SEED_MAX}, got {text!r}")
    return value


class Distinct(argparse.Action):
    """For nargs='+' lists whose values must differ (two equal seeds would be counted
    as two seeds)."""

    def __call__(self, parser, namespace, values, option_string=None):
        repeated = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if repeated is not None:
            parser.error(f"argument {option_string}: {repeated:g} is given twice"
                         if isinstance(repeated, float)
                         else f"argument {option_string}: {repeated} is given twice")
        setattr(namespace, self.dest, values)


def cluster_name(text):
    """A cluster id as the run folder names it: 'all' or ASCII digits ('٣' is a digit
    to Python, but names no folder)."""
    if text != "all" and not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(
            f"a cluster is 'all' or a number written in ASCII digits, got {text!r}")
    return text


def contribution_name(text):
    """argparse type of --contribution: a name that cannot be mistaken for a cluster id or
    a single model."""
    if not CONTRIBUTION_NAME.fullmatch(text) or text in SINGLE_MODELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a contribution name: a letter, then up to 63 letters, digits, "
            f"'_', '.' or '-' (not {' or '.join(SINGLE_MODELS)}; numbers are k-means "
            "clusters)")
    return text


def class_list(text):
    """argparse type of --classes: distinct class labels, e.g. 0,1,2."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected class labels like 0,1,2, got {text!r}")
    labels = sorted(int(p) for p in parts)
    if len(set(labels)) != len(labels):
        raise argparse.ArgumentTypeError(f"{text!r} names a class twice")
    return labels


def device_type(text):
    """--device: the CPU, or a CUDA device this machine has (the project's code runs on
    those two; another torch device type would fail later, in the middle of a run)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (cpu, cuda or cuda:N)")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(
            f"--device {text}: this project runs on cpu or cuda (cuda:N), not on {device.type}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"--device {text}: no CUDA device is available here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"--device {text}: this machine has "
                                         f"{torch.cuda.device_count()} CUDA device(s)")
    return text


def first_line(error):
    """An exception as one short line, also when its message is empty (EOFError) or
    long (torch's unpickler)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


NUMBER = (int, float)


# a JSON reader's words for the Python types a schema names
JSON_KINDS = {int: "an integer", float: "a number", str: "a string", dict: "a record",
              list: "a list", bool: "true or false", type(None): "null"}


def kind_of(types):
    """'a number' for NUMBER, else each type in a JSON reader's words: 'a record or null'."""
    named = ["a number"] if set(types) >= set(NUMBER) else []
    named += [JSON_KINDS.get(t, t.__name__) for t in types
              if not (named and t in NUMBER)]
    return " or ".join(named)


def checked_record(record, schema, path):
    """A record read back from `path`, checked against `schema` ({field: type or tuple of
    types}): every field present and of its type (bool is no number), every float finite.
    A field whose types include None may be absent or null. Refused in one line naming
    the file and the field."""
    if not isinstance(record, dict):
        raise UsageError(f"{path}: holds a {type(record).__name__}, not a record (a JSON object)")
    for field, types in schema.items():
        types = types if isinstance(types, tuple) else (types,)
        allowed = tuple(t for t in types if t is not type(None))
        value = record.get(field)
        if value is None and len(allowed) < len(types):
            continue
        if field not in record:
            raise UsageError(f"{path}: no field {field!r}")
        if not isinstance(value, allowed) or isinstance(value, bool) and bool not in allowed:
            raise UsageError(f"{path}: field {field!r} is {value!r}, not {kind_of(types)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{path}: field {field!r} is {value}, not a finite number")
    return record
