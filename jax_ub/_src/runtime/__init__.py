"""The userbuffer runtime: compiled extensions, communicators, their bootstrap and teardown."""
