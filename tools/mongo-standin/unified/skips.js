'use strict';
// Tests of source/transactions/tests/unified (mongodb/specifications) the
// stand-in's run skips, with the reason; the README's "Transactions" lists
// them too. Whole files are keyed by file name with description '*'.
// (Tests for sharded and load-balanced topologies and newer servers skip by
// their own runOnRequirements.)

const CLIENT_BACKPRESSURE = 'client side: the Node.js driver 6.20 does not retry on the SystemOverloadedError/'
  + 'RetryableError labels (the client backpressure retries these tests expect)';
const WRITE_AFTER_CLUSTER_TIME = 'client side: the Node.js driver 6.20 sends no readConcern.afterClusterTime on a '
  + 'write outside a transaction (DRIVERS-3274, newer than the driver)';
const DDL_IN_TXN = 'stand-in: create/createIndexes inside a transaction are not built (263); the library '
  + 'creates no collection or index in a transaction';
const SECONDARY = 'topology: needs a secondary (the Node.js driver connects selecting a server by the client\'s '
  + 'readPreference, secondary); the stand-in is a replica set of one member, a one-member mongod set times out too';

module.exports = {
  'backpressure-retryable-abort.json': { '*': CLIENT_BACKPRESSURE },
  'backpressure-retryable-commit.json': { '*': CLIENT_BACKPRESSURE },
  'backpressure-retryable-reads.json': { '*': CLIENT_BACKPRESSURE },
  'backpressure-retryable-writes.json': { '*': CLIENT_BACKPRESSURE },
  'commit.json': {
    'reset session state commit': WRITE_AFTER_CLUSTER_TIME,
    'reset session state abort': WRITE_AFTER_CLUSTER_TIME,
  },
  'retryable-writes.json': { 'increment txnNumber': WRITE_AFTER_CLUSTER_TIME },
  'create-collection.json': { 'explicitly create collection using create command': DDL_IN_TXN },
  'create-index.json': {
    'create index on a non-existing collection': DDL_IN_TXN,
    'create index on a collection created within the same transaction': DDL_IN_TXN,
  },
  'run-command.json': {
    'run command with secondary read preference in client option and primary read preference in transaction options':
      SECONDARY,
  },
  'transaction-options.json': { 'readPreference inherited from client': SECONDARY },
  // source/transactions-convenient-api/tests/unified
  'callback-aborts.json': {
    'withTransaction still succeeds if callback aborts and runs extra op': WRITE_AFTER_CLUSTER_TIME,
  },
  'callback-commits.json': {
    'withTransaction still succeeds if callback commits and runs extra op': WRITE_AFTER_CLUSTER_TIME,
  },
};
