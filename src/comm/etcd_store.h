// The rendezvous table kept in etcd (`--rdzv-backend=etcd`), the store large sites run for
// their schedulers: agents survive an etcd restart (etcd keeps its keys on disk) and no
// node of the job has to serve the table.
//
// It talks to etcd's v3 API through the JSON gateway every etcd 3.4+ serves on its client
// URL (POST /v3/kv/range, /v3/kv/txn; keys and values base64), with libcurl: set-once is a
// transaction on the key's create revision being 0, add a compare-and-swap on its mod
// revision, retried. Connection errors are retried until the timeout (etcd restarting).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "comm/rendezvous.h"

namespace moetrain {

// `endpoint`: host:port of etcd's client URL, or a full http(s):// URL.
std::unique_ptr<RendezvousStore> open_etcd_store(const std::string& endpoint, std::chrono::milliseconds timeout);

std::string base64_encode(const std::string& bytes);
std::string base64_decode(const std::string& text);  // throws on characters outside the alphabet

}  // namespace moetrain
