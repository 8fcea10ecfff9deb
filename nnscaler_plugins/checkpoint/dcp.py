"""torch.distributed.checkpoint (DCP) directories: read as a weight source, written by `export_dcp`."""
from __future__ import annotations

import os

DCP_METADATA = ".metadata"


def is_dcp_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, DCP_METADATA)) and \
        not os.path.exists(os.path.join(path, "metadata.json"))
