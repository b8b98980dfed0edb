// Finishes the CommonJS build (tsconfig.cjs.json) in the directory given:
// - marks it CommonJS: the package is "type": "module", so without a
//   package.json of its own saying otherwise Node reads its .js files as ES
//   modules;
// - points its declarations at the addon's: tsc copies the sources' relative
//   `../native/index.js`, right from dist/ (the ES module build) but one level
//   short from dist/cjs/. Only the build's top folder has sources that name
//   the addon; a declaration anywhere that still names `../native/` fails the
//   build rather than ship a type that resolves to nothing.
import { readdirSync, readFileSync, writeFileSync } from 'node:fs';
import * as path from 'node:path';

const [dir] = process.argv.slice(2);
if (!dir) throw new Error('usage: finish-commonjs.mjs <dir>');
writeFileSync(path.join(dir, 'package.json'), `${JSON.stringify({ type: 'commonjs' })}\n`);
const declarations = readdirSync(dir, { recursive: true, encoding: 'utf8' }).filter(f => /\.d\.c?ts$/.test(f));
for (const file of declarations) {
  const full = path.join(dir, file);
  const text = readFileSync(full, 'utf8');
  const fixed = path.dirname(file) === '.' ? text.replace(/(['"])\.\.\/native\//g, '$1../../native/') : text;
  if (/(['"])\.\.\/native\//.test(fixed)) throw new Error(`${full} names ../native/, which is not the addon's folder from there`);
  if (fixed !== text) writeFileSync(full, fixed);
}
