/* mongoc_probe URI MODE: drives the server through libmongoc 1.23 and prints
 * one line per step as "name ok|error <json>". MODE is "single" (one
 * mongoc_client_t) or "pool" (a mongoc_client_pool_t, whose monitor threads
 * must accept the server as a replica-set primary). */
#include <mongoc/mongoc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void show(const char *name, bool ok, const bson_t *reply, const bson_error_t *err) {
  char *json = reply ? bson_as_relaxed_extended_json(reply, NULL) : NULL;
  if (ok) printf("%s ok %s\n", name, json ? json : "{}");
  else printf("%s error %u %s\n", name, err->code, err->message);
  bson_free(json);
  fflush(stdout);
}

static int run(mongoc_client_t *client) {
  bson_error_t err;
  bson_t reply;
  bool ok;
  int failures = 0;
  bson_t *ping = BCON_NEW("ping", BCON_INT32(1));
  ok = mongoc_client_command_simple(client, "admin", ping, NULL, &reply, &err);
  show("ping", ok, &reply, &err);
  failures += !ok;
  bson_destroy(&reply);
  bson_destroy(ping);

  mongoc_collection_t *coll = mongoc_client_get_collection(client, "probe", "locks");
  bson_t *drop = BCON_NEW("delete", BCON_UTF8("locks"), "deletes", "[", "{", "q", "{", "}", "limit", BCON_INT32(0), "}", "]");
  ok = mongoc_client_command_simple(client, "probe", drop, NULL, &reply, &err);
  bson_destroy(&reply);
  bson_destroy(drop);

  /* the lock-style acquire of doc/design.md, twice: the second is a no-op */
  for (int i = 0; i < 2; i++) {
    bson_t *query = BCON_NEW("_id", BCON_UTF8("job"));
    bson_t *update = BCON_NEW(
      "0", "{", "$set", "{",
        "owner", "{", "$cond", "[",
          "{", "$or", "[", "{", "$eq", "[", "{", "$ifNull", "[", BCON_UTF8("$owner"), BCON_NULL, "]", "}", BCON_NULL, "]", "}",
                           "{", "$lte", "[", BCON_UTF8("$expiresAt"), BCON_UTF8("$$NOW"), "]", "}", "]", "}",
          BCON_UTF8(i == 0 ? "me" : "other"), BCON_UTF8("$owner"), "]", "}",
        "token", "{", "$max", "[", "{", "$add", "[", "{", "$ifNull", "[", BCON_UTF8("$token"), BCON_INT64(0), "]", "}", BCON_INT64(1), "]", "}",
                                 "{", "$multiply", "[", "{", "$toLong", BCON_UTF8("$$NOW"), "}", BCON_INT64(1024), "]", "}", "]", "}",
        "expiresAt", "{", "$add", "[", BCON_UTF8("$$NOW"), BCON_INT64(60000), "]", "}",
      "}", "}");
    bson_t *fields = BCON_NEW("owner", BCON_INT32(1), "token", BCON_INT32(1),
                              "remainingMs", "{", "$subtract", "[", BCON_UTF8("$expiresAt"), BCON_UTF8("$$NOW"), "]", "}");
    mongoc_find_and_modify_opts_t *opts = mongoc_find_and_modify_opts_new();
    mongoc_find_and_modify_opts_set_update(opts, update);
    mongoc_find_and_modify_opts_set_fields(opts, fields);
    mongoc_find_and_modify_opts_set_flags(opts, MONGOC_FIND_AND_MODIFY_UPSERT | MONGOC_FIND_AND_MODIFY_RETURN_NEW);
    ok = mongoc_collection_find_and_modify_with_opts(coll, query, opts, &reply, &err);
    show(i == 0 ? "acquire" : "contend", ok, &reply, &err);
    failures += !ok;
    bson_destroy(&reply);
    mongoc_find_and_modify_opts_destroy(opts);
    bson_destroy(fields);
    bson_destroy(update);
    bson_destroy(query);
  }

  bson_t *doc = BCON_NEW("_id", BCON_UTF8("job"));
  ok = mongoc_collection_insert_one(coll, doc, NULL, &reply, &err);
  show("duplicate", ok, &reply, &err);
  failures += ok; /* must fail with E11000 */
  bson_destroy(&reply);
  bson_destroy(doc);

  bson_t *filter = BCON_NEW("_id", BCON_UTF8("job"));
  mongoc_cursor_t *cur = mongoc_collection_find_with_opts(coll, filter, NULL, NULL);
  const bson_t *d;
  int n = 0;
  while (mongoc_cursor_next(cur, &d)) {
    n++;
    show("find", true, d, NULL);
  }
  ok = !mongoc_cursor_error(cur, &err);
  if (!ok) show("find", false, NULL, &err);
  failures += !ok || n != 1;
  mongoc_cursor_destroy(cur);
  bson_destroy(filter);
  mongoc_collection_destroy(coll);
  return failures;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s URI single|pool\n", argv[0]);
    return 2;
  }
  mongoc_init();
  bson_error_t err;
  mongoc_uri_t *uri = mongoc_uri_new_with_error(argv[1], &err);
  if (!uri) {
    fprintf(stderr, "bad uri: %s\n", err.message);
    return 2;
  }
  mongoc_uri_set_option_as_int32(uri, MONGOC_URI_SERVERSELECTIONTIMEOUTMS, 5000);
  int failures;
  if (strcmp(argv[2], "pool") == 0) {
    mongoc_client_pool_t *pool = mongoc_client_pool_new(uri);
    mongoc_client_t *client = mongoc_client_pool_pop(pool);
    failures = run(client);
    mongoc_client_pool_push(pool, client);
    mongoc_client_pool_destroy(pool);
  } else {
    mongoc_client_t *client = mongoc_client_new_from_uri(uri);
    failures = run(client);
    mongoc_client_destroy(client);
  }
  mongoc_uri_destroy(uri);
  mongoc_cleanup();
  printf("failures %d\n", failures);
  return failures ? 1 : 0;
}
