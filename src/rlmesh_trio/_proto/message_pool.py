# Generated from proto/ by `nox -s codegen` (betterproto2-compiler) -- do not edit.
import betterproto2

default_message_pool = betterproto2.MessagePool()
