"""The `dsv4debug` command line: a thin typer + rich skin over the Python API.

Every command lives in dsv4debug/commands/<group>.py and calls into the API; this file only assembles them
and maps errors to exit codes (BadInput, a GPU out of memory and a path the system refuses -> 2 with one
message, no traceback).
"""
from __future__ import annotations

import functools
import sys

import torch
import typer
from rich.console import Console

from .errors import BadInput

# help texts are plain: they quote TOML tables and regexes with [brackets]
app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Find where a DeepSeek-V4 inference pipeline goes numerically wrong.")
err_console = Console(stderr=True, soft_wrap=True)


@functools.cache          # once a process: main() called again (tests, scripts) must not add the commands again
def _register() -> None:  # (each call did, and typer rebuilt every copy at every call: 30 s a call after 300)
    from .commands import captures, checkpoint, gate, model
    app.add_typer(checkpoint.app, name="checkpoint", help="Synthetic real-format checkpoints; inspect; verify.")
    for module in (model, captures, gate):
        module.register(app)
    from .commands import kernels
    kernels.register(app)


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        rc = app(args=argv, standalone_mode=False)   # click returns typer.Exit codes here
    except BadInput as e:
        _fail(str(e))
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(2)
    except typer.TyperException as e:               # usage errors: bad option, missing argument
        e.show()
        sys.exit(2)
    except torch.cuda.OutOfMemoryError as e:        # the model, tokens or capture do not fit this GPU
        _fail(_out_of_memory(e))
    except OSError as e:                             # a path the system refused: missing folder, no permission,
        _fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))   # a directory, a full disk
    sys.exit(rc if isinstance(rc, int) else 0)


def _fail(message: str) -> None:
    """One line on stderr, exit 2."""
    err_console.print("[bold red]error:[/] ", end="")
    err_console.print(message, markup=False, highlight=False)   # messages may hold [brackets]
    sys.exit(2)


def _out_of_memory(e: torch.cuda.OutOfMemoryError) -> str:
    """One line for a GPU out of memory: torch's first sentence, what was allocated at the peak, what helps."""
    what = str(e).split(". ")[0].strip()
    gib = 2 ** 30
    peak = f"; peak allocated {torch.cuda.max_memory_allocated() / gib:.2f} GiB" if torch.cuda.is_available() else ""
    return (f"out of GPU memory ({what}{peak}): fewer tokens (--seq-len, --tokens), part of the model "
            "(--layers A:B) or stats-only captures need less; a run holds one layer's weights at a time")
