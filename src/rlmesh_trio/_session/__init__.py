"""Join semantics, sans-IO: events in, actions out (SPEC §6, §7, §9).

:class:`Endpoint` is the server-wide state (contract, conformance ledger, Handshake and
Shutdown answers); :class:`Session` is one Join stream. Neither imports the lanes or the
transport: the transport's Join driver performs the actions.
"""

from ._endpoint import PROTOCOL_GENERATION as PROTOCOL_GENERATION
from ._endpoint import ConformanceLedger as ConformanceLedger
from ._endpoint import Endpoint as Endpoint
from ._join import Action as Action
from ._join import CancelTimer as CancelTimer
from ._join import Done as Done
from ._join import EndStream as EndStream
from ._join import Post as Post
from ._join import Report as Report
from ._join import Send as Send
from ._join import Session as Session
from ._join import StartTimer as StartTimer
from ._join import rust_debug_str as rust_debug_str
from ._results import CONFORMANCE_KEY as CONFORMANCE_KEY
from ._results import batch_infos as batch_infos
from ._results import fold_phases as fold_phases
