-- The child process of spec/unit_exit_spec.lua: registers an exit handler
-- that creates MARK (testing.exit_mark), then, after its MODE, writes "bye"
-- to stdout without a newline or a flush and exits with status 7.
--   open     a client is made (its pool too) and left open
--   closed   a client is made and closed
--   none     no client at all
local mode, mark = ...
local testing = require "mongolock.testing"
local mongolock = require "mongolock"
local DEAD = "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=200&connectTimeoutMS=200"

testing.exit_mark(mark)
if mode ~= "none" then
  local c = assert(mongolock.connect(DEAD))
  if mode == "closed" then c:close() end
  _G.kept = c
end
io.stdout:setvbuf("full")
io.stdout:write("bye")
os.exit(7)
