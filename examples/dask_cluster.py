"""examples/dask_cluster.py - the README's Dask example: a LocalCluster of
dmem workers (one per GPU; one worker on dmem's host backend without a GPU)
computing over more data than the device limit.

    PYTHONPATH=build/default/python python3 examples/dask_cluster.py

Exit 77 when dask or distributed is missing, 0 when the sum is right.
"""
import os
import shutil
import sys
import tempfile


def main():
    try:
        import dask.array as da
    except ImportError as e:
        print(f"dask_cluster: skipped: {e}")
        return 77
    # [example]
    from distributed import Client
    from dmem.dask import LocalCluster
    client = Client(LocalCluster(device_memory_limit="8GB"))   # one worker per GPU
    # [example]
    client.close()
    client.cluster.close()
    # The same, small: a 16 MiB limit on the host backend, 64 MiB of data.
    with LocalCluster(backend="host", device_memory_limit="16MiB", n_workers=1,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        x = da.ones((2048, 4096), chunks=(256, 4096), dtype="float64")  # 64 MiB
        total = (x + 1).sum().compute()
        assert total == 2 * 2048 * 4096, total
        spills = client.run(lambda dask_worker: dask_worker.data.runtime.stats()["spill_count"])
        print(f"dask_cluster: OK, sum {total:.0f}, spills per worker {sorted(spills.values())}")
    return 0


if __name__ == "__main__":
    # Dask's workers keep their scratch space under DASK_TEMPORARY_DIRECTORY,
    # else in $TMPDIR/dask-scratch-space, which stays: a folder of our own,
    # removed at the end (set before dask is imported; the spawned workers
    # inherit it).
    scratch = tempfile.mkdtemp(prefix="dmem-example-dask-")
    os.environ["DASK_TEMPORARY_DIRECTORY"] = scratch
    try:
        rc = main()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(rc)
