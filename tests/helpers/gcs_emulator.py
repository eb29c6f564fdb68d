"""``gcp-storage-emulator`` with the object-generation headers real GCS sends on a download
(``x-goog-generation``, ``x-goog-metageneration``), which tensorstore's gcs driver reads (an
OCDBT manifest's version) and the emulator leaves out. Run as a script:

    python gcs_emulator.py PORT
"""

import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # not found: the emulator's own answer stands
        return
    response["x-goog-generation"] = str(obj.get("generation", "1"))
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))


objects.download = download

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main

    main(["start", "--host=localhost", f"--port={sys.argv[1]}", "--in-memory"])
