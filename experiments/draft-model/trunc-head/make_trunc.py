"""Writes a copy of the Q4_0-requantized Qwen2.5-Coder 0.5B draft GGUF whose vocabulary, token
embedding and output head keep only the N most frequent tokens of the shipped Qwen2.5 ranking
(plus the special and padding ids), to time what the head costs a llama.cpp draft decode.

    python make_trunc.py SRC.gguf DST.gguf 32768
"""

import sys
from pathlib import Path

import gguf
import numpy as np

RANKING = Path(__file__).resolve().parents[3] / "src/specdec/speculators/vocab/4764b397b3f8a2f9.u32"
VOCAB, FIRST_SPECIAL = 151936, 151643


def main() -> None:
    src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    r = gguf.GGUFReader(src)
    rank = np.fromfile(RANKING, dtype=np.uint32).astype(np.int64)
    keep = np.unique(np.concatenate([rank[:n], np.arange(FIRST_SPECIAL, VOCAB)]))
    new_of = np.full(VOCAB, -1)
    new_of[keep] = np.arange(len(keep))
    print("kept", len(keep))
    w = gguf.GGUFWriter(dst, arch="qwen2")
    scalar = {
        gguf.GGUFValueType.UINT32: w.add_uint32,
        gguf.GGUFValueType.FLOAT32: w.add_float32,
        gguf.GGUFValueType.BOOL: w.add_bool,
        gguf.GGUFValueType.INT32: w.add_int32,
    }
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        if k == "tokenizer.ggml.tokens":
            toks = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
            w.add_token_list([toks[i] for i in keep])
        elif k == "tokenizer.ggml.token_type":
            types = [int(f.parts[i][0]) for i in f.data]
            w.add_token_types([types[i] for i in keep])
        elif k == "tokenizer.ggml.merges":
            w.add_token_merges([bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data])
        elif k.endswith("_token_id"):
            w.add_uint32(k, int(new_of[int(f.parts[f.data[0]][0])]))
        elif vt == gguf.GGUFValueType.STRING:
            w.add_string(k, bytes(f.parts[f.data[0]]).decode())
        else:
            scalar[vt](k, f.parts[f.data[0]][0].item())
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name in ("output.weight", "token_embd.weight"):
            data = data[keep]
        raw_shape = data.shape if t.tensor_type == gguf.GGMLQuantizationType.F32 else None
        w.add_tensor(t.name, data, raw_shape=raw_shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
