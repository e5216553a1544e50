"""Built on the public API: compare, sweep, plan, validation, nccl-tests and the executor they
share (local, Ray, Dask; a failed variant is a row)."""
