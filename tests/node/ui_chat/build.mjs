// Bundles page.jsx with esbuild into OUT_DIR/page.js (+ index.html): `node build.mjs OUT_DIR`.
import { build } from "esbuild";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const out = process.argv[2];
if (!out) throw new Error("usage: node build.mjs OUT_DIR");
mkdirSync(out, { recursive: true });
await build({
  entryPoints: [fileURLToPath(new URL("page.jsx", import.meta.url))],
  bundle: true, format: "esm", target: "es2022", minify: true, jsx: "automatic", outfile: join(out, "page.js"),
  define: { "process.env.NODE_ENV": '"production"' }, logLevel: "warning",
});
writeFileSync(join(out, "index.html"),
  '<!doctype html><meta charset="utf-8"><title>useChat</title><div id="root"></div>' +
  '<script type="module" src="page.js"></script>\n');
