'use strict';
// A command failure with MongoDB's code and codeName; the dispatcher turns it
// into {ok: 0, errmsg, code, codeName}.

// mongod's table of error codes and names (error_codes.json says from
// which file of mongod it was taken). A code mongod raises by number only
// (an assertion such as 40324) has no entry: its name is Location<code>.
const TABLE = require('./error_codes.json');
const NAMES = TABLE.names;
const NON_RESUMABLE = new Set(TABLE.categories.NonResumableChangeStreamError);

function codeName(code) {
  return NAMES[code] || `Location${code}`;
}

// mongod labels the errors of this category NonResumableChangeStreamError
// when a change stream's aggregate or getMore fails with them
function nonResumable(code) {
  return NON_RESUMABLE.has(code);
}

class MongoError extends Error {
  constructor(code, message, extra) {
    super(message);
    this.code = code;
    this.codeName = codeName(code);
    this.extra = extra;
  }
}

function fail(code, message, extra) {
  throw new MongoError(code, message, extra);
}

module.exports = { MongoError, fail, codeName, nonResumable };
