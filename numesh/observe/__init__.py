"""Observability: what watches the mesh through its one hook (`mesh.observer`,
numesh/mesh/hook.py) and the training loop's spans.

* `trace`: `Tracer`, a Chrome trace-event timeline of a run (`numesh train --trace`);
  `recover` rebuilds it from the parts a job that died left;
* `spool`: those parts, each rank's events on disk as the run goes;
* `flight`: `FlightRecorder`, every rank's recent calls in a memory-mapped ring, and a
  diagnosis and MPI_Abort when a collective never ends; `postmortem` reads the rings a
  killed job left behind;
* `witness`: a process outside the job that sees which rank ended first;
* `diagnosis`: `diagnose`, that diagnosis, a pure function of the ranks' states;
* `inject`: `FaultInjector`, the faults of `NUMESH_INJECT` (hang, skip, crash, mismatch, slow);
* `observers`: `Recorder` (every call, in order), `Chain` (several observers at once) and
  `attach` (add one to a mesh).

The mesh knows only the hook; nothing below this package imports it.
"""

from numesh.mesh.hook import Observer, SkipCall
from numesh.observe.diagnosis import RankState, diagnose
from numesh.observe.flight import FlightRecorder, postmortem
from numesh.observe.inject import Fault, FaultInjector, faults_from_env, parse_faults
from numesh.observe.observers import Call, Chain, Recorder, attach
from numesh.observe.trace import Tracer

__all__ = [
    "Call", "Chain", "Fault", "FaultInjector", "FlightRecorder", "Observer", "RankState", "Recorder", "SkipCall",
    "Tracer", "attach", "diagnose", "faults_from_env", "parse_faults", "postmortem",
]
