"""Type stub for the Cython extension `preloop._native`."""

import os

def tree_bytes(
    path: str | bytes | os.PathLike[str] | os.PathLike[bytes], one_file_system: bool = True
) -> tuple[int, int, int, int, int]: ...
