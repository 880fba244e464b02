"""What every entry point shares to run: the device and dtype choice, the process group (`Dist`),
autocast, up-front checks of option values, and the Hydra wrapper that turns bad input into one
line on stderr and exit code 2.

Exit codes of train.py, sample.py and eval.py: 0 done; 2 bad input or a refused request (one
line, no traceback); 1 a disk that is full (one line) or a bug (traceback); 130 Ctrl-C (SIGINT);
143 SIGTERM. `HYDRA_FULL_ERROR=1` shows the traceback of every error.
"""
import contextlib
import errno
import functools
import os
import re
import sys
import typing
from typing import Callable, NamedTuple

import hydra
import torch
import torch.distributed as dist
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

# What bad input raises (GPTConfig, the data loader, the option checks below, missing or unwritable
# files, a config value left `???`): printed as one line, exit 2.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, MissingMandatoryValue)
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}   # EFBIG: past a file-size limit


# ----------------------------------------------------------------------------- device, dtype

def choose_device(name="auto", local_rank=0):
    """auto: this local rank's CUDA device when CUDA is visible, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name} but no CUDA device is visible; use device=auto or cpu")
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def choose_dtype(name, device):
    """auto: bf16 on CUDA, fp32 elsewhere (autocast for training, the weights for inference)."""
    if name not in ("auto", "bf16", "fp32"):
        raise ValueError(f"dtype={name!r}; choose auto, bf16 or fp32")
    if name == "bf16" or (name == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def autocast_context(device, dtype):
    """bf16 autocast for a bf16 choice; fp32 runs as written."""
    if dtype == torch.bfloat16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Dist:
    """Rank, world size and device of this process; a process group when launched by torchrun
    (NCCL on GPUs, gloo on CPU; one GPU per local rank). `rank` and `world` are global (over every
    node), the device is chosen by the local rank (LOCAL_RANK: the rank within this node)."""

    def __init__(self, device_cfg="auto"):
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.device = choose_device(device_cfg, int(os.environ.get("LOCAL_RANK", 0)))
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        if self.world > 1:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.master = self.rank == 0

    def mean(self, value):
        """Mean of a float over ranks."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world

    def any(self, flag):
        """True on every rank when the flag is set on any rank."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() > 0

    def check_shared_dir(self, path, option):
        """With several nodes, every rank must see the files rank 0 writes in `path` (it writes the
        checkpoints, and every rank reads one to resume): rank 0 writes a marker there and every
        rank looks for it. A directory local to each node raises a ValueError on every rank."""
        if self.world == 1 or self.local_world == self.world:
            return
        token = torch.tensor([int.from_bytes(os.urandom(7), "big") if self.master else 0], device=self.device)
        dist.all_reduce(token)                   # rank 0's token on every rank
        marker = os.path.join(path, f".shared-check-{token.item()}")
        if self.master:
            with open(marker, "w"):
                pass
        dist.barrier()
        missing = self.any(not os.path.exists(marker))
        if self.master:
            os.remove(marker)
        if missing:
            raise ValueError(f"{option}={path} is not the same directory on every node: rank 0 writes the "
                             "checkpoints there and every rank reads one to resume. Put it on a filesystem "
                             "all nodes share (NFS, Lustre, ...) under the same path")

    def close(self):
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- option checks

class Rule(NamedTuple):
    ok: Callable[[object], bool]
    expected: str
    convert: Callable[[object], object] = lambda v: v     # what `checked` returns for a value that is ok


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(low=None):
    return Rule(lambda v: _is_int(v) and (low is None or v >= low),
                "an integer" + (f" >= {low}" if low is not None else ""))


def number(low=None, high=None, *, above=None, below=None):
    """A float or int in [low, high]; `above` / `below`: strictly greater / less than it. `checked`
    returns it as a float."""
    def ok(v):
        return (_is_number(v) and (low is None or v >= low) and (high is None or v <= high)
                and (above is None or v > above) and (below is None or v < below))
    bounds = [f"{op} {x}" for op, x in ((">", above), (">=", low), ("<", below), ("<=", high)) if x is not None]
    return Rule(ok, "a number" + (" " + " and ".join(bounds) if bounds else ""), float)


def one_of(*choices):
    """Exactly one of these values (true is not 1)."""
    return Rule(lambda v: any(v == c and type(v) is type(c) for c in choices),
                "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices))


def text(nonempty=True):
    return Rule(lambda v: isinstance(v, str) and (v != "" or not nonempty),
                "a non-empty string" if nonempty else "a string")


def boolean():
    return Rule(lambda v: isinstance(v, bool), "true or false")


def optional(rule):
    return Rule(lambda v: v is None or rule.ok(v), rule.expected + ", or null",
                lambda v: None if v is None else rule.convert(v))


def pair(rule):
    return Rule(lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(rule.ok(x) for x in v),
                f"two values [a, b], each {rule.expected}")


def _items(v):
    """A list as a list; any other value as a list of that one item."""
    return list(v) if isinstance(v, (list, tuple)) or OmegaConf.is_list(v) else [v]


def listed(rule, empty=False):
    """A list whose items each keep `rule` (one item alone stands for a one-item list); non-empty
    unless `empty`. `checked` returns it as a list of the converted items."""
    return Rule(lambda v: (len(_items(v)) > 0 or empty) and all(rule.ok(x) for x in _items(v)),
                f"a{'' if empty else ' non-empty'} list, each {rule.expected}",
                lambda v: [rule.convert(x) for x in _items(v)])


def _is_device_name(v):
    if v == "auto":
        return True
    try:
        torch.device(v)
    except (RuntimeError, TypeError):
        return False
    return isinstance(v, str)


DEVICE = Rule(_is_device_name, "auto, cpu, cuda or cuda:N")


def shown(value):
    """A config value as it is written on the command line."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
        return "[" + ",".join(shown(v) for v in value) + "]"
    return str(value)


def check_options(values, rules):
    """Raise ValueError naming the first option whose value breaks its rule.

    values: {dotted option name: value} (plain Python values); rules: {dotted option name: Rule}."""
    for key, rule in rules.items():
        value = values[key]
        if not rule.ok(value):
            raise ValueError(f"{key}={shown(value)} is invalid: it must be {rule.expected}")


def checked(value, option, rule):
    """`value` (as `rule` converts it) if it keeps `rule`, else the ValueError check_options raises."""
    check_options({option: value}, {option: rule})
    return rule.convert(value)


TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


def check_dataclass_types(cls, values, prefix):
    """Raise ValueError naming the first key of `values` whose type does not fit the dataclass field
    (`int | None`, `float` also takes an int, `bool` takes only true/false)."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in hints:           # an unknown key: GPTConfig.from_dict names it
            continue
        allowed = typing.get_args(hints[key]) or (hints[key],)
        fits = any(value is None if t is type(None) else
                   isinstance(value, bool) if t is bool else
                   _is_number(value) if t is float else
                   _is_int(value) if t is int else isinstance(value, t) for t in allowed)
        if not fits:
            names = " or ".join(TYPE_NAMES.get(t, t.__name__) for t in allowed)
            raise ValueError(f"{prefix}{key}={shown(value)} is invalid: it must be {names}")


# ----------------------------------------------------------------------------- entry points

def entry_point(config_name, literal_keys=()):
    """Decorator: run the task function as a Hydra app on configs/<config_name>.yaml.

    Bad input (USER_ERRORS, and Hydra's own errors for unknown groups, keys or override syntax)
    prints `<script>: error: <message>` as one line and exits 2; a full disk prints one line and
    exits 1; anything else is a bug and keeps its traceback. `literal_keys`: options whose
    command-line value is taken as literal text (Unicode, quotes, commas, `${`), without Hydra's
    quoting rules."""
    def decorate(task):
        @functools.wraps(task)
        def job(cfg):
            try:
                with user_errors():
                    return task(cfg)
            except KeyboardInterrupt:
                raise SystemExit(130) from None

        hydra_job = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name=config_name)(job)

        @functools.wraps(task)
        def main():
            sys.argv[1:] = [quote_literal(arg, literal_keys) for arg in sys.argv[1:]]
            with _hydra_raises():
                try:
                    hydra_job()
                except HydraException as e:
                    fail(ValueError(f"{e}{groups_with_option(str(e))}"), 2)
        return main
    return decorate


@contextlib.contextmanager
def user_errors():
    """The entry points' error policy, for the argparse scripts too: bad input (USER_ERRORS) prints
    `<script>: error: <message>` as one line and exits 2, a full disk one line and exit 1; anything
    else is a bug and keeps its traceback."""
    try:
        yield
    except USER_ERRORS as e:
        fail(e, 2)
    except OSError as e:
        if e.errno not in DISK_FULL_ERRNOS:
            raise
        fail(e, 1)


def groups_with_option(message):
    """For Hydra's "Could not override 'G.KEY'" where KEY is absent from the chosen group G: the
    groups of configs/G/ that have KEY, so the user knows which group to pick first ('' otherwise)."""
    match = re.search(r"Could not override '(\w+)\.(\w+)'", message)
    if not match:
        return ""
    group, key = match.groups()
    folder = os.path.join(CONFIG_DIR, group)
    if not os.path.isdir(folder):
        return ""
    def defines(name):
        with open(os.path.join(folder, name)) as f:
            return re.search(rf"^{key}:", f.read(), re.M) is not None

    having = sorted(name[:-5] for name in os.listdir(folder) if name.endswith(".yaml") and defines(name))
    if not having:
        return f" ({group}.{key} is not an option of any {group} group)"
    return f" ({group}.{key} is an option of {group}=" + "|".join(having) + ": choose one of them first)"


def fail(error, code):
    """One line on stderr, then exit `code`; with HYDRA_FULL_ERROR=1 the error keeps its traceback."""
    if _FULL_ERROR:
        raise error
    script = os.path.basename(sys.argv[0])
    print(f"{script}: error: {' '.join(str(error).split())}", file=sys.stderr)
    raise SystemExit(code) from None


_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"


@contextlib.contextmanager
def _hydra_raises():
    """Hydra prints its own short traceback and exits 1 for every error, unless HYDRA_FULL_ERROR
    is set: then it raises, and `entry_point` decides how each error is reported."""
    old = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = old


def quote_literal(arg, keys):
    """`key=value` -> `key='value'` quoted for Hydra so that the value arrives unchanged: quotes and
    backslashes before them escaped, `${` kept from interpolating."""
    key, sep, value = arg.partition("=")
    if not sep or key not in keys:
        return arg
    value = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    value = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    value = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, value)
    return f"{key}='{value}'"
