// Finishes the CommonJS build (tsconfig.cjs.json) in the directory given:
// - marks it CommonJS: the package is "type": "module", so without a
//   package.json of its own saying otherwise Node reads its .js files as ES
//   modules;
// - points its declarations at the addon's: tsc copies the sources' relative
//   `../native/index.js`, right from dist/ (the ES module build) but one level
//   short from dist/cjs/.
import { readdirSync, readFileSync, writeFileSync } from 'node:fs';
import * as path from 'node:path';

const [dir] = process.argv.slice(2);
if (!dir) throw new Error('usage: finish-commonjs.mjs <dir>');
writeFileSync(path.join(dir, 'package.json'), `${JSON.stringify({ type: 'commonjs' })}\n`);
for (const file of readdirSync(dir).filter(f => f.endsWith('.d.ts') || f.endsWith('.d.cts'))) {
  const full = path.join(dir, file);
  const text = readFileSync(full, 'utf8');
  const fixed = text.replaceAll("'../native/index.js'", "'../../native/index.js'");
  if (fixed !== text) writeFileSync(full, fixed);
}
