// Fixes a dynalite 4.0.0 bug after `npm ci` (package.json "postinstall").
//
// dynalite keys each GSI entry by the index key plus the first six hex digits of an
// md5 of the item's table key.  Items with the same index key (thousands of free items
// share `by_state_expiry` = (STARTED, 0)) whose six digits collide overwrite each
// other's entry, so about n^2 / 33.5 M of them vanish from the index: a released
// connection that nobody is hinted about is then never found by reconcile.  DynamoDB
// itself has no such limit.  Using the whole digest keeps keys unique; every caller
// goes through hashPrefix, so table and index keys stay consistent.
"use strict";
const fs = require("fs");
const path = require("path");

const file = path.join(__dirname, "..", "node_modules", "dynalite", "db", "index.js");
const buggy = ".update(rangeKey).digest('hex').slice(0, 6)";
const fixed = ".update(rangeKey).digest('hex')";
const src = fs.readFileSync(file, "utf8");
if (src.includes(buggy)) {
  fs.writeFileSync(file, src.replace(buggy, fixed));
  console.log("patched dynalite: full-length key hashes (GSI entries no longer collide)");
} else if (src.includes(fixed)) {
  console.log("dynalite already patched");
} else {
  console.error("patch-dynalite: expected code not found in " + file + " (dynalite version changed?)");
  process.exit(1);
}
