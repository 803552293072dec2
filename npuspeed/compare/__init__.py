"""`npuspeed compare A B`: where two dumped runs (`--npuspeed-dump`) part. load.py reads and checks
a dump, logical.py puts tensor-parallel shards back into the model's tensors, diverge.py finds the
first step, module and direction beyond the dtypes' tolerance, cli.py prints it (a table, a PNG,
--json)."""
