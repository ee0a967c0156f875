"""pool.yaml: read and validate the pool at the edge, with one line naming a bad field."""
from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from gpu_pool.pool import Pool, local_pool


class PoolFileError(ValueError):
    """A pool file that cannot be used; the message is one line naming the file and field."""


def load_pool(path: Path | str | None) -> Pool:
    """The pool in `path`, or this machine alone when no file is given."""
    if path is None:
        return local_pool()
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise PoolFileError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise PoolFileError(f"{path}: not a text file (not UTF-8)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise PoolFileError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise PoolFileError(f"{path}: expected a mapping with a `hosts:` list")
    try:
        pool = Pool.model_validate(data)
    except ValidationError as e:
        raise PoolFileError(f"{path}: {_where(e.errors()[0], data)}") from None
    return _resolve_paths(pool, path.parent)


def _where(err: dict, data: dict) -> str:
    """`hosts[1] (h100-a).port: <message>` from pydantic's first error."""
    parts, node = [], data
    for loc in err["loc"]:
        if isinstance(loc, int):
            name = node[loc].get("name") if isinstance(node, list) and isinstance(node[loc], dict) else None
            parts[-1] += f"[{loc}]" + (f" ({name})" if name else "")
        else:
            parts.append(str(loc))
        node = node[loc] if isinstance(node, (dict, list)) and _has(node, loc) else None
    field = ".".join(parts) or "file"
    return f"{field}: {err['msg'].removeprefix('Value error, ')}"


def _has(node, loc) -> bool:
    return loc in node if isinstance(node, dict) else isinstance(loc, int) and loc < len(node)


def _resolve_paths(pool: Pool, base: Path) -> Pool:
    """Key and known_hosts paths are relative to the pool file, `~` is the user's home."""
    def fix(p: Path | None) -> Path | None:
        if p is None:
            return None
        p = p.expanduser()
        return p if p.is_absolute() else (base / p).resolve()

    return pool.model_copy(update={"hosts": [h.model_copy(update={"key_file": fix(h.key_file),
                                                                  "known_hosts": fix(h.known_hosts)})
                                             for h in pool.hosts]})
