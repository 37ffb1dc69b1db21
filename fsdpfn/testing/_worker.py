"""Worker process of :mod:`fsdpfn.testing.pool` (not a public API).

Started by the pool as ``python -m fsdpfn.testing._worker --rank R ...``.  The worker
connects back to the parent's ``Listener``, says hello, joins a gloo process group and
then serves calls until told to exit (or until the parent goes away).

Protocol (every message is ``conn.send_bytes(pickle.dumps(obj))``; plain pickle):

* worker -> parent: ``("hello", rank, pid)``, then ``("ready",)`` or
  ``("init_error", type_name, message, traceback_text, pickled_exc_or_None)``.
* parent -> worker: ``("call", payload)`` where ``payload = pickle.dumps((fn, args))``,
  ``("tidy",)`` (no reply: sent once every rank has answered a call; see ``_tidy_groups``),
  ``("renew", init_method)`` (sent after a call in which ranks raised but every rank answered, or after
  one that left the ranks' groups apart; see ``_renew_groups``), or ``("exit",)``.
* worker -> parent, once per call: ``("ok", result, state)`` (the counters of its process groups that
  must agree between ranks, ``fsdpfn.testing._groups.groups_state``) or
  ``("error", type_name, message, traceback_text, pickled_exc_or_None)``; once per renew:
  ``("renewed",)`` or ``("renew_error", ...)`` (the worker then exits).

The worker prints nothing itself.  ``faulthandler`` writes fatal-error dumps and the
stack dumps requested with ``SIGUSR1`` to the per-worker ``--log`` file.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any

from fsdpfn.testing._groups import groups_state, last_operations
from fsdpfn.testing._wire import receive, send, without_delay

AUTHKEY_ENV = "FSDPFN_SPMD_AUTHKEY"
PG_TIMEOUT_ENV = "FSDPFN_SPMD_PG_TIMEOUT"


def detach_result(obj: Any) -> Any:
    """Return ``obj`` with every tensor inside tuples/lists/dicts detached.

    Detaching makes tensors that require grad (or are non-leaf) picklable.

    Example::

        >>> import torch
        >>> detach_result({"a": (torch.ones(1, requires_grad=True) * 2,)})["a"][0].requires_grad
        False
    """
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, tuple):
        items = [detach_result(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return type(obj)(detach_result(x) for x in obj)
    if isinstance(obj, dict):
        items = {k: detach_result(v) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:  # e.g. defaultdict: fall back to a plain dict
            return items
    return obj


def error_reply(exc: BaseException, tag: str = "error", skip: int = 0) -> tuple:
    """Describe ``exc`` as a picklable ``(tag, type_name, message, traceback, blob)``.

    ``skip`` leading traceback frames (the worker's own) are left out of the text.
    """
    tb_obj = exc.__traceback__
    for _ in range(skip):
        if tb_obj is not None and tb_obj.tb_next is not None:
            tb_obj = tb_obj.tb_next
    tb = "".join(traceback.format_exception(type(exc), exc, tb_obj))
    try:
        message = str(exc)
    except Exception:  # pragma: no cover - pathological __str__
        message = f"<unprintable {type(exc).__name__}>"
    try:
        blob: bytes | None = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # make sure it also unpickles (custom __init__ often doesn't)
    except Exception:
        blob = None
    module = type(exc).__module__
    name = type(exc).__qualname__
    type_name = name if module == "builtins" else f"{module}.{name}"
    return (tag, type_name, message, tb, blob)


def _run_call(payload: bytes, rank: int) -> bytes:
    try:
        fn, args = pickle.loads(payload)
        reply: tuple = ("ok", detach_result(fn(*args)), groups_state())
    except BaseException as exc:  # noqa: BLE001 - report everything, incl. SystemExit
        tag, kind, message, tb, blob = error_reply(exc, skip=1)
        recent = last_operations()
        if recent:  # which collectives this rank ran last: where diverged ranks parted
            tb += f"\nthis rank's last operations (torch's flight recorder), oldest first:\n{recent}"
        reply = (tag, kind, message, tb, blob, groups_state())  # (the pool's report compares the counters)
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001
        err = TypeError(f"the result of fn on rank {rank} is not picklable: {exc!r}")
        return pickle.dumps(error_reply(err), protocol=pickle.HIGHEST_PROTOCOL)


TIDY_ABOVE = 16  # call-made process groups a worker may hold before it destroys the unused ones


def _tidy_groups(keep: set, held_before: int) -> int:
    """Destroy the process groups calls made and nothing uses any more, once there are more than
    ``TIDY_ABOVE`` of them besides the ``held_before`` that the last tidy found in use.  Returns how
    many call-made groups are left (the next call's ``held_before``): groups a test keeps alive do
    not make every later call scan the heap.

    Meshes and ``new_group`` calls inside calls leave gloo groups behind, and every group keeps
    transport threads that wake many times a second: a world-4 worker that had served a few hundred
    calls held ~100 groups and spent 11-18% of a core idle.  This runs between calls, after every rank
    returned, and locally (destroying a group communicates nothing).  Kept: groups a live
    ``DeviceMesh`` names or a live object holds (a mesh or group a test caches across calls), and
    groups named by a hash of their ranks (``new_group(..., use_local_synchronization=True)``, as
    FSDP2's separate reduce-scatter group): a later group over the same ranks takes the same name and
    rendezvous keys, and would read the destroyed one's stale addresses.
    """
    import gc
    import types

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    world = c10d._world
    made = [g for g in list(world.pg_map) if g not in keep and world.pg_names.get(g, "").isdigit()]
    if len(made) <= held_before + TIDY_ABOVE:
        return held_before
    _forget_meshes()  # DTensor's caches hold the meshes of finished calls alive
    gc.collect()  # and their modules sit in reference cycles
    named: set[str] = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh):
            names = getattr(obj, "_dim_group_names", None)
            if names is None:  # a torch whose meshes keep groups differently: destroy nothing
                return len(made)
            named.update(n for n in names if n is not None)
    candidates = [g for g in made if world.pg_names[g] not in named]
    registries = [world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag]
    registries += [getattr(world, "pg_coalesce_state", None), made, candidates, *world.tags_to_pg.values()]
    ignore = {id(r) for r in registries if r is not None}
    held: set[int] = set()
    for ref in gc.get_referrers(*candidates):
        if id(ref) not in ignore and not isinstance(ref, types.FrameType):
            held.update(id(x) for x in gc.get_referents(ref))
    unused = [g for g in candidates if id(g) not in held]
    for group in unused:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - a group torch already dropped
            pass
    return len(made) - len(unused)


def _renew_groups(rank: int, world_size: int, init_method: str) -> None:
    """Destroy every process group and join a fresh default group at ``init_method``.

    After a call in which ranks raised, the groups may hold what the call left behind: point-to-point
    messages a rank sent and its peer never received (a later receive with the same tag would take
    them), or collective counters that differ between ranks. New groups have new connections, so
    nothing crosses over, and the worker keeps its imported modules (starting a process costs
    seconds). Meshes and groups a test cached across calls do not survive this.
    """
    import gc

    import torch.distributed as dist

    _forget_meshes()  # DTensor's caches hold meshes alive, as in _tidy_groups
    gc.collect()  # and the failed call's tensors and works sit in cycles with its frames
    dist.destroy_process_group()  # every group, the default one included
    _init_default_group(rank, world_size, init_method)


def _init_default_group(rank: int, world_size: int, init_method: str) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV) or 60))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=init_method, timeout=timeout)


def _forget_meshes() -> None:
    """Clear DTensor's caches (and anything else in ``torch.distributed.tensor`` that caches).

    DTensor caches redistribution planners, mesh topologies and sharding propagation by mesh
    *equality* (layout and names, not groups): they keep finished calls' meshes alive, and would hand
    a later call's equal mesh results naming the groups destroyed here.  Clearing a cache only costs
    recomputation, so every one found is cleared rather than a list that changes with torch versions.
    """
    import torch

    clears = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("torch.distributed.tensor", "torch.distributed.device_mesh")):
            continue
        for obj in list(vars(module).values()):
            clears.append(getattr(obj, "cache_clear", None))
            if isinstance(obj, type) and obj.__module__ == name:
                for attr in list(vars(obj).values()):
                    clears.append(getattr(getattr(attr, "__func__", attr), "cache_clear", None))
        clears.append(getattr(module, "clear_redistribute_planner_cache", None))
    dtensor = sys.modules.get("torch.distributed.tensor")
    dispatcher = getattr(getattr(dtensor, "DTensor", None), "_op_dispatcher", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    clears.append(getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None))
    clears.append(getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None))  # the C++ fast path's
    for clear in clears:
        if callable(clear):
            try:
                clear()
            except Exception:  # noqa: BLE001 - a cache_clear that wants arguments is not one of these
                pass


def main(argv: list[str] | None = None) -> int:
    """Run one pool worker; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m fsdpfn.testing._worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--parent", required=True, help="host:port of the parent Listener")
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--log", required=True)
    ns = parser.parse_args(argv)

    # Ctrl-C belongs to the parent; it shuts the pool down (atexit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log = open(ns.log, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    faulthandler.enable(file=log, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)

    host, port = ns.parent.rsplit(":", 1)
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    conn = without_delay(Client((host, int(port)), authkey=authkey))
    send(conn, ("hello", ns.rank, os.getpid()))

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        _init_default_group(ns.rank, ns.world_size, ns.init_method)
    except BaseException as exc:  # noqa: BLE001
        send(conn, error_reply(exc, tag="init_error"))
        return 2
    from torch.distributed import distributed_c10d as c10d

    keep = set(c10d._world.pg_map)  # the pool's own group(s); everything later is a call's
    held = 0  # call-made groups the last tidy found in use
    send(conn, ("ready",))

    while True:
        try:
            msg = receive(conn)
        except (EOFError, OSError):  # the parent went away
            break
        if msg[0] == "exit":
            break
        if msg[0] == "tidy":
            held = _tidy_groups(keep, held)
            continue
        if msg[0] == "renew":
            try:
                _renew_groups(ns.rank, ns.world_size, msg[1])
            except BaseException as exc:  # noqa: BLE001 - the parent discards the pool
                send(conn, error_reply(exc, tag="renew_error"))
                return 3
            keep, held = set(c10d._world.pg_map), 0
            send(conn, ("renewed",))
            continue
        if msg[0] == "call":
            try:
                conn.send_bytes(_run_call(msg[1], ns.rank))
            except OSError:  # the parent went away while we were busy
                break

    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except (EOFError, OSError):  # the parent went away: exit quietly
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's (slow, torch-heavy) teardown
