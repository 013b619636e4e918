# Generated from proto/ by `nox -s codegen` (betterproto2-compiler) -- do not edit.
