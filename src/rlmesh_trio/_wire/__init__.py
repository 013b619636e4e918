"""The wire format, sans-IO: protobuf fields, the request decoders, the reply encoder,
gRPC framing (one message cutter for server and client) and the size limit, the
protocol's names. Nothing here does I/O or imports asyncio."""

from .._errors import DecodeError as DecodeError
from ._decode import Clipped as Clipped
from ._decode import decode_join_request as decode_join_request
from ._encode import encode_join_response as encode_join_response
from ._encode import encode_join_response_framed as encode_join_response_framed
from ._encode import encode_meta_map as encode_meta_map
from ._framing import PREFIX_SIZE as PREFIX_SIZE
from ._framing import SMALL_MESSAGE as SMALL_MESSAGE
from ._framing import MessageReader as MessageReader
from ._framing import check_outgoing as check_outgoing
from ._framing import decode_grpc_message as decode_grpc_message
from ._framing import encode_grpc_message as encode_grpc_message
from ._framing import frame as frame
from ._framing import parse_prefix as parse_prefix
from ._protobuf import decode_message as decode_message
from ._protocol import HANDSHAKE_PATH as HANDSHAKE_PATH
from ._protocol import HEALTH_CHECK_PATH as HEALTH_CHECK_PATH
from ._protocol import HEALTH_SERVICE_NAME as HEALTH_SERVICE_NAME
from ._protocol import JOIN_PATH as JOIN_PATH
from ._protocol import PROTOCOL_GENERATION as PROTOCOL_GENERATION
from ._protocol import SERVICE_NAME as SERVICE_NAME
from ._protocol import SHUTDOWN_PATH as SHUTDOWN_PATH
from ._protocol import WORKFLOW_EDITION as WORKFLOW_EDITION
from ._unary import HEALTH_NOT_SERVING as HEALTH_NOT_SERVING
from ._unary import HEALTH_SERVING as HEALTH_SERVING
from ._unary import decode_handshake_request as decode_handshake_request
from ._unary import decode_health_request as decode_health_request
from ._unary import decode_shutdown_request as decode_shutdown_request
from ._unary import encode_health_response as encode_health_response
