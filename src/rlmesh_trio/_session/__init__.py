"""Join semantics, sans-IO: events in, actions out (SPEC §6, §7, §9).

:class:`Endpoint` is the server-wide state (contract, conformance ledger, Handshake and
Shutdown answers); :class:`Session` is one Join stream. Neither imports the lanes or the
transport: the transport's Join driver performs the actions.
"""

from .._wire._protocol import PROTOCOL_GENERATION as PROTOCOL_GENERATION
from ._actions import Action as Action
from ._actions import CancelTimer as CancelTimer
from ._actions import Done as Done
from ._actions import EndStream as EndStream
from ._actions import Post as Post
from ._actions import Report as Report
from ._actions import Send as Send
from ._actions import StartTimer as StartTimer
from ._actions import Wedged as Wedged
from ._edition import rust_debug_str as rust_debug_str
from ._endpoint import ConformanceLedger as ConformanceLedger
from ._endpoint import Endpoint as Endpoint
from ._join import Session as Session
from ._results import CONFORMANCE_KEY as CONFORMANCE_KEY
from ._results import LANE_FAULT_KEY as LANE_FAULT_KEY
from ._results import batch_infos as batch_infos
from ._results import fold_phases as fold_phases
