/*
 * Locks on the application's own documents (documents.c).
 *
 * May include: compat.h.
 */
#ifndef MONGOLOCK_DOCUMENTS_H
#define MONGOLOCK_DOCUMENTS_H

#include "compat.h"

/* Client methods: doc_acquire, doc_acquire_attempt, doc_status */
extern const luaL_Reg ml_documents_methods[];

#endif
