"""The batch engine behind ``vitexplain export`` and ``vitexplain caption`` (also usable from Python).

One module per concern (file writing itself, shared with the gallery and the explorer, is
:mod:`vitexplain.files`):

============== ===========================================================================
options        the options base: each option's flag, help, check and whether it changes outputs
inputs         input discovery and stable, safe output keys
models         model loading (offline) and the model's part of the resume key
decoding       the DataLoader: decode, preprocess, crop; a bad file is a record
outfolder      output-folder checks (writable, own names), stale temporary files
manifest       manifest parts written whole, repaired on read, merged at the end
lock           one run at a time per output folder
run            the run's types (Run, Command, ExportResult), exit codes, messages
signals        Ctrl-C and SIGTERM: stop the work once, never cut the finishing short
checks         checks the commands share (finite maps and outputs)
distributed    devices, torchrun shards and collectives
setup          what every command checks before its model runs
driver         the run: lock, shard, resume, summary
integrity      what resume trusts: each output file's recorded size, mtime and digest
shard          one rank's decode -> explain -> write loop
summary        ``summary.json``
export         ``vitexplain export`` (classifiers: overlays and maps)
caption        ``vitexplain caption`` (captioners: per-word figures and maps)
explore        ``vitexplain explore`` (one interactive page, :func:`vitexplain.explore`)
============== ===========================================================================

Import the commands from their modules (``from vitexplain.batch.export import ExportOptions,
export``).
Importing this package is light (no torch, no OpenCV): the CLI builds its flags from here.
"""

from .run import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_TERMINATED,
    EXIT_USAGE,
    ExportResult,
)
from .inputs import IMAGE_EXTENSIONS, InputItem, discover_inputs, scan_inputs
from .lock import FolderBusyError
from .signals import Interrupted
from .manifest import read_manifest
from .models import load_model
from .options import BatchOptions
from ..files import OutputError

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_OUTPUT",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "ExportResult",
    "Interrupted",
    "OutputError",
    "FolderBusyError",
    "BatchOptions",
    "IMAGE_EXTENSIONS",
    "InputItem",
    "discover_inputs",
    "scan_inputs",
    "read_manifest",
    "load_model",
]
