"""A stack of the services on one host: `kvpop up`, `down`, `status`, `restart` and the
supervisor, and `kvpop generate` / `kvpop keys` against it."""
