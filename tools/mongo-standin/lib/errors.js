'use strict';
// A command failure with MongoDB's code and codeName; the dispatcher turns it
// into {ok: 0, errmsg, code, codeName}.

const NAMES = {
  1: 'InternalError', 2: 'BadValue', 4: 'NoSuchKey', 9: 'FailedToParse', 11: 'UserNotFound',
  14: 'TypeMismatch', 15: 'Overflow', 16: 'InvalidLength', 20: 'IllegalOperation', 22: 'InvalidBSON',
  26: 'NamespaceNotFound', 27: 'IndexNotFound', 28: 'PathNotViable', 40: 'ConflictingUpdateOperators',
  43: 'CursorNotFound', 48: 'NamespaceExists', 50: 'MaxTimeMSExpired', 52: 'DollarPrefixedFieldName',
  56: 'EmptyFieldName', 59: 'CommandNotFound', 66: 'ImmutableField', 67: 'CannotCreateIndex',
  68: 'IndexAlreadyExists', 72: 'InvalidOptions', 73: 'InvalidNamespace', 85: 'IndexOptionsConflict',
  86: 'IndexKeySpecsConflict', 91: 'ShutdownInProgress', 96: 'OperationFailed', 115: 'CommandNotSupported',
  168: 'InvalidPipelineOperator', 175: 'QueryPlanKilled', 197: 'InvalidIndexSpecificationOption',
  236: 'CursorKilled', 241: 'ConversionFailure', 251: 'NoSuchTransaction', 263: 'OperationNotSupportedInTransaction',
  280: 'ChangeStreamFatalError', 286: 'ChangeStreamHistoryLost', 11000: 'DuplicateKey',
  11600: 'InterruptedAtShutdown', 11601: 'Interrupted', 11602: 'InterruptedDueToReplStateChange',
  10107: 'NotWritablePrimary', 13435: 'NotPrimaryNoSecondaryOk', 189: 'PrimarySteppedDown',
  91001: 'Location91001', 262: 'ExceededTimeLimit', 6: 'HostUnreachable', 7: 'HostNotFound',
  89: 'NetworkTimeout', 9001: 'SocketException', 64: 'WriteConcernFailed', 100: 'UnsatisfiableWriteConcern',
  13: 'Unauthorized', 18: 'AuthenticationFailed', 24: 'LockTimeout', 112: 'WriteConflict',
  117: 'ConflictingOperationInProgress', 134: 'ReadConcernMajorityNotAvailableYet',
};

function codeName(code) {
  return NAMES[code] || `Location${code}`;
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

module.exports = { MongoError, fail, codeName };
