"""What every layer may use, and which imports nothing else of levanter_flax: the one-line user
error (errors), how a setting is declared and checked (schema, checks), user paths local and
gs:// (paths), progress of long work, file locks, child-process lifetimes, FLOP counting and the
command line's shared plumbing (cli)."""
