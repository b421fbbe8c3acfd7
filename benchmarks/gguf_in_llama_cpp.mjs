// Decode a GGUF file in llama.cpp (through node-llama-cpp's prebuilt CPU binaries, from npm),
// for a like-for-like comparison with our engine on the very same file:
//
//   mkdir /tmp/nlc && cd /tmp/nlc && npm install node-llama-cpp@3.22.1   # prebuilt, no compiler
//   cp .../benchmarks/gguf_in_llama_cpp.mjs . && node gguf_in_llama_cpp.mjs MODEL.gguf 16
//
// Prints the layer count llama.cpp read, the greedy text and decode tok/s (2 threads).
import {getLlama, LlamaChatSession} from "node-llama-cpp";
const path = process.argv[2];
const n = parseInt(process.argv[3] || "32");
const llama = await getLlama({gpu: false, build: "never"});
const model = await llama.loadModel({modelPath: path});
const ctx = await model.createContext({contextSize: 512, threads: 2});
const seq = ctx.getSequence();
const tokens = model.tokenize("The ocean is");
let out = [];
const t0 = performance.now();
let first = null;
for await (const tok of seq.evaluate(tokens, {temperature: 0})) {
  if (first === null) first = performance.now();
  out.push(tok);
  if (out.length >= n) break;
}
const t1 = performance.now();
console.log(JSON.stringify({layers: model.fileInsights?.totalLayers, text: model.detokenize(out),
  decode_tok_s: (out.length - 1) / ((t1 - first) / 1000), tokens: out.length}));
