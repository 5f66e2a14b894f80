// TCP rendezvous: rank 0 listens, the others connect, and all traffic is a
// star through rank 0. Every socket is non-blocking and every wait goes
// through poll() with the time left, so no call outlives the caller's timeout.
//
// Wire format, integers big-endian:
//   hello  peer -> root  u32 magic, u32 rank, u32 size
//   frame  root -> peer  u32 status, u64 length, then `length` bytes: the
//                        payload if status is kStatusOk, else an error text
// Constructor: peer sends hello; root answers an empty frame once every rank
// is in. all_gather: peer sends u64 length; root answers an empty frame once
// all lengths agree; peer sends its bytes; root answers a frame with all.
// The root checks lengths before any payload moves, so a mismatch leaves no
// unread bytes behind and the peers get the root's explanation intact.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>

#include "runtime/socket_wait.hpp"
#include "turnout/bootstrap.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

using net::Clock;
using net::deadline_after;
using net::errno_text;
using net::kTimedOut;
using net::ms_left;
using net::ranks_text;
using net::wait_fd;
using std::chrono::milliseconds;

constexpr uint32_t kMagic = 0x54524e31;  // "TRN1": bump the digit when the wire format changes
constexpr uint32_t kStatusOk = 0;
constexpr uint32_t kStatusError = 1;
constexpr uint32_t kStatusTimeout = 2;
constexpr size_t kHelloBytes = 12;
constexpr size_t kFrameBytes = 12;
constexpr size_t kLengthBytes = 8;
constexpr uint64_t kMaxMessageBytes = 1 << 16;  // longer error texts are truncated

// Results of the I/O helpers besides 0 (done), net::kTimedOut and a positive errno.
constexpr int kClosed = -1;

// What every error message needs: who we are and how long we waited.
struct Ctx {
  int rank;
  int size;
  milliseconds timeout;
  Clock::time_point deadline;
};

template <class T>
void put_be(unsigned char* p, T v) {
  for (size_t i = sizeof(T); i-- > 0; v >>= 8) p[i] = static_cast<unsigned char>(v & 0xff);
}

template <class T>
T get_be(const unsigned char* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v = static_cast<T>((v << 8) | p[i]);
  return v;
}

std::string who(int rank) {
  return "TcpBootstrap rank " + std::to_string(rank) + ": ";
}

std::string addr_text(const sockaddr_in& addr) {
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof ip);
  return std::string(ip) + ":" + std::to_string(ntohs(addr.sin_port));
}

[[noreturn]] void throw_timeout(const Ctx& c, const char* step, const std::vector<int>& silent,
                                const std::string& detail = "") {
  throw TimeoutError(who(c.rank) + "timed out after " + std::to_string(c.timeout.count()) + " ms in " + step +
                     "; not heard from " + ranks_text(silent) + detail);
}

// Turns an I/O helper's result into the exception for this step and peer.
[[noreturn]] void throw_io(const Ctx& c, int code, const char* step, int peer) {
  if (code == kTimedOut) throw_timeout(c, step, {peer});
  if (code == kClosed)
    throw Error(who(c.rank) + "rank " + std::to_string(peer) + " closed the connection during " + step);
  throw Error(who(c.rank) + step + " with rank " + std::to_string(peer) + " failed: " + errno_text(code));
}

int read_exact(int fd, void* buf, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<unsigned char*>(buf);
  while (n > 0) {
    const ssize_t got = recv(fd, p, n, 0);
    if (got > 0) {
      p += got;
      n -= static_cast<size_t>(got);
      continue;
    }
    if (got == 0) return kClosed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
    if (const int rc = wait_fd(fd, POLLIN, deadline); rc != 0) return rc;
  }
  return 0;
}

int write_exact(int fd, const void* buf, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<const unsigned char*>(buf);
  while (n > 0) {
    // MSG_NOSIGNAL: a vanished peer must give EPIPE, not kill the process.
    const ssize_t sent = send(fd, p, n, MSG_NOSIGNAL);
    if (sent >= 0) {
      p += sent;
      n -= static_cast<size_t>(sent);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
    if (const int rc = wait_fd(fd, POLLOUT, deadline); rc != 0) return rc;
  }
  return 0;
}

// One recv without waiting; `done` grows by what came.
int read_some(int fd, unsigned char* p, size_t n, size_t& done) {
  const ssize_t got = recv(fd, p, n, 0);
  if (got > 0) {
    done += static_cast<size_t>(got);
    return 0;
  }
  if (got == 0) return kClosed;
  return (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : errno;
}

// Non-blocking so that poll() alone decides how long anything waits.
int configure(int fd) {
  const int one = 1;
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) return errno;
  if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) return errno;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0) return errno;
  return 0;
}

int new_socket(const Ctx& c) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    const int err = errno;
    throw Error(who(c.rank) + "socket() failed: " + errno_text(err));
  }
  if (const int err = configure(fd); err != 0) {
    close(fd);
    throw Error(who(c.rank) + "cannot configure a socket: " + errno_text(err));
  }
  return fd;
}

sockaddr_in resolve(int rank, const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0)
    throw Error(who(rank) + "cannot resolve root_host '" + host + "': " + gai_strerror(rc));
  sockaddr_in addr{};
  std::memcpy(&addr, found->ai_addr, sizeof addr);
  freeaddrinfo(found);
  addr.sin_port = htons(port);
  return addr;
}

void close_all(int& listen_fd, std::vector<int>& peers) {
  if (listen_fd >= 0) close(listen_fd);
  listen_fd = -1;
  for (int fd : peers)
    if (fd >= 0) close(fd);
  peers.clear();
}

int send_frame(int fd, uint32_t status, std::span<const std::byte> body, Clock::time_point deadline) {
  unsigned char head[kFrameBytes];
  put_be<uint32_t>(head, status);
  put_be<uint64_t>(head + 4, body.size());
  if (const int rc = write_exact(fd, head, sizeof head, deadline); rc != 0) return rc;
  return write_exact(fd, body.data(), body.size(), deadline);
}

// Best effort and never waits: a peer that cannot take the text now learns
// of the failure from the closed socket instead.
void send_abort(int fd, const Error& e) {
  const uint32_t status = dynamic_cast<const TimeoutError*>(&e) != nullptr ? kStatusTimeout : kStatusError;
  const size_t len = std::min<size_t>(std::strlen(e.what()), kMaxMessageBytes);
  std::vector<unsigned char> frame(kFrameBytes + len);
  put_be<uint32_t>(frame.data(), status);
  put_be<uint64_t>(frame.data() + 4, len);
  std::memcpy(frame.data() + kFrameBytes, e.what(), len);
  (void)send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
}

// Reads one frame from the root and checks its length; if the root sent its
// failure instead, rethrows it here with the same type.
void read_frame(const Ctx& c, int fd, const char* step, uint64_t expected) {
  unsigned char head[kFrameBytes];
  const int rc = read_exact(fd, head, sizeof head, c.deadline);
  // The root stays silent while any rank is missing, so point the reader at
  // the root's error rather than at the root.
  if (rc == kTimedOut)
    throw_timeout(c, step, {0}, " (it answers once every rank has arrived; its error names any missing)");
  if (rc != 0) throw_io(c, rc, step, 0);
  const uint32_t status = get_be<uint32_t>(head);
  const uint64_t length = get_be<uint64_t>(head + 4);
  if (status == kStatusOk && length == expected) return;
  if (status == kStatusOk || length > kMaxMessageBytes)
    throw Error(who(c.rank) + "protocol error in " + step + ": rank 0 announced " + std::to_string(length) +
                " bytes with status " + std::to_string(status) + ", expected " + std::to_string(expected));
  std::string text(length, '\0');
  if (const int err = read_exact(fd, text.data(), text.size(), c.deadline); err != 0) throw_io(c, err, step, 0);
  const std::string what = who(c.rank) + step + " aborted by rank 0: " + text;
  if (status == kStatusTimeout) throw TimeoutError(what);
  throw Error(what);
}

// With nothing listening, a loopback connect can pick the target port as its
// own source port and connect to itself (TCP simultaneous open).
bool is_self_connected(int fd) {
  sockaddr_in self{}, peer{};
  socklen_t self_len = sizeof self, peer_len = sizeof peer;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&self), &self_len) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0)
    return false;
  return self.sin_port == peer.sin_port && self.sin_addr.s_addr == peer.sin_addr.s_addr;
}

int connect_once(int fd, const sockaddr_in& addr, Clock::time_point deadline) {
  int err = 0;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    // After EINTR the connection still proceeds in the background.
    if (errno != EINPROGRESS && errno != EINTR) return errno;
    if (const int rc = wait_fd(fd, POLLOUT, deadline); rc != 0) return rc;
    socklen_t len = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  }
  if (err == 0 && is_self_connected(fd)) return ECONNREFUSED;
  return err;
}

// The root may start after us, so failures are retried until the deadline.
int connect_with_retry(const Ctx& c, const sockaddr_in& addr) {
  auto backoff = milliseconds(10);
  int last_err = 0;
  for (;;) {
    const int fd = new_socket(c);
    const int rc = connect_once(fd, addr, c.deadline);
    if (rc == 0) return fd;
    close(fd);
    if (rc != kTimedOut) last_err = rc;
    if (Clock::now() >= c.deadline)
      throw_timeout(c, "connect", {0},
                    " at " + addr_text(addr) + (last_err ? " (last error: " + errno_text(last_err) + ")" : ""));
    std::this_thread::sleep_until(std::min(Clock::now() + backoff, c.deadline));
    backoff = std::min(backoff * 2, milliseconds(500));
  }
}

void join_root(const Ctx& c, const sockaddr_in& root, std::vector<int>& peers) {
  peers.assign(1, connect_with_retry(c, root));
  unsigned char hello[kHelloBytes];
  put_be<uint32_t>(hello, kMagic);
  put_be<uint32_t>(hello + 4, static_cast<uint32_t>(c.rank));
  put_be<uint32_t>(hello + 8, static_cast<uint32_t>(c.size));
  if (const int rc = write_exact(peers[0], hello, sizeof hello, c.deadline); rc != 0) throw_io(c, rc, "connect", 0);
  // The go-ahead comes once every rank is in, so the constructor is collective.
  read_frame(c, peers[0], "connect", 0);
}

int open_listener(const Ctx& c, const sockaddr_in& addr) {
  const int fd = new_socket(c);
  const int one = 1;
  // SO_REUSEADDR: connections of an earlier job in TIME_WAIT must not block the port.
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    close(fd);
    throw Error(who(c.rank) + "cannot listen on " + addr_text(addr) + ": " + errno_text(err));
  }
  return fd;
}

std::vector<int> missing_ranks(const std::vector<int>& peers) {
  std::vector<int> ranks;
  for (size_t r = 1; r < peers.size(); ++r)
    if (peers[r] < 0) ranks.push_back(static_cast<int>(r));
  return ranks;
}

int accept_one(const Ctx& c, int listen_fd, const std::vector<int>& peers) {
  for (;;) {
    const int fd = accept(listen_fd, nullptr, nullptr);
    if (fd >= 0) {
      if (const int err = configure(fd); err != 0) {
        close(fd);
        throw Error(who(c.rank) + "cannot configure an accepted socket: " + errno_text(err));
      }
      return fd;
    }
    const int err = errno;
    // The connection died in the backlog: keep waiting for the next one.
    if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
    if (err != EAGAIN && err != EWOULDBLOCK) throw Error(who(c.rank) + "accept failed: " + errno_text(err));
    const int rc = wait_fd(listen_fd, POLLIN, c.deadline);
    if (rc == kTimedOut) throw_timeout(c, "accept", missing_ranks(peers));
    if (rc != 0) throw Error(who(c.rank) + "waiting for connections failed: " + errno_text(rc));
  }
}

// Returns the rank a new connection claims, or -1 for a stranger (no hello or
// the wrong magic), which is dropped: anything may knock on an open port. A
// hello of ours that does not fit this job means the job is misconfigured.
int admit(const Ctx& c, int fd, const std::vector<int>& peers) {
  unsigned char hello[kHelloBytes];
  const int rc = read_exact(fd, hello, sizeof hello, c.deadline);
  if (rc == kTimedOut) {
    close(fd);
    throw_timeout(c, "accept", missing_ranks(peers));
  }
  if (rc != 0 || get_be<uint32_t>(hello) != kMagic) {
    close(fd);
    return -1;
  }
  const uint32_t rank = get_be<uint32_t>(hello + 4);
  const uint32_t size = get_be<uint32_t>(hello + 8);
  std::string problem;
  if (size != static_cast<uint32_t>(c.size))
    problem = "rank " + std::to_string(rank) + " was started with size " + std::to_string(size) +
              ", rank 0 with size " + std::to_string(c.size);
  else if (rank == 0 || rank >= size)
    problem = "a peer claims rank " + std::to_string(rank) + ", outside [1, " + std::to_string(size) + ")";
  else if (peers[rank] >= 0)
    problem = "two peers claim rank " + std::to_string(rank) + " (duplicate rank)";
  if (problem.empty()) return static_cast<int>(rank);
  const Error rejected(who(c.rank) + problem);
  send_abort(fd, rejected);
  close(fd);
  throw rejected;
}

void accept_peers(const Ctx& c, const sockaddr_in& addr, int& listen_fd, std::vector<int>& peers) {
  listen_fd = open_listener(c, addr);
  peers.assign(static_cast<size_t>(c.size), -1);
  for (int missing = c.size - 1; missing > 0;) {
    const int fd = accept_one(c, listen_fd, peers);
    const int rank = admit(c, fd, peers);
    if (rank < 0) continue;
    peers[static_cast<size_t>(rank)] = fd;
    --missing;
  }
  // Free the port as soon as everyone is in, so that the next job can use it.
  close(listen_fd);
  listen_fd = -1;
  for (int r = 1; r < c.size; ++r)
    if (const int rc = send_frame(peers[r], kStatusOk, {}, c.deadline); rc != 0) throw_io(c, rc, "accept", r);
}

// Reads n bytes from every peer at once into dst + rank * n, so that a
// timeout names every rank still silent, not just the first one.
void gather_exact(const Ctx& c, const std::vector<int>& peers, unsigned char* dst, size_t n, const char* step) {
  std::vector<size_t> got(peers.size(), 0);
  std::vector<int> pending, still;
  std::vector<pollfd> polls;
  for (int r = 1; r < c.size && n > 0; ++r) pending.push_back(r);
  while (!pending.empty()) {
    polls.clear();
    for (int r : pending) polls.push_back({peers[r], POLLIN, 0});
    const int rc = poll(polls.data(), polls.size(), ms_left(c.deadline));
    if (rc == 0 && Clock::now() >= c.deadline) throw_timeout(c, step, pending);
    if (rc < 0 && errno != EINTR) {
      const int err = errno;
      throw Error(who(c.rank) + "poll failed in " + step + ": " + errno_text(err));
    }
    still.clear();
    for (size_t i = 0; i < pending.size(); ++i) {
      const int r = pending[i];
      if (polls[i].revents != 0)
        if (const int err = read_some(peers[r], dst + r * n + got[r], n - got[r], got[r]); err != 0)
          throw_io(c, err, step, r);
      if (got[r] < n) still.push_back(r);
    }
    pending.swap(still);
  }
}

void check_lengths(const Ctx& c, const std::vector<unsigned char>& lengths, size_t mine) {
  std::string differ;
  for (int r = 1; r < c.size; ++r) {
    const uint64_t n = get_be<uint64_t>(&lengths[r * kLengthBytes]);
    if (n != mine) differ += "rank " + std::to_string(r) + " passed " + std::to_string(n) + " bytes, ";
  }
  if (!differ.empty())
    throw Error(who(c.rank) + "all_gather needs the same length on every rank, but " + differ + "rank 0 passed " +
                std::to_string(mine));
}

// If this throws, the next thing every peer reads is a frame header, so the
// caller can send them the reason.
std::vector<std::byte> root_collect(const Ctx& c, const std::vector<int>& peers, std::span<const std::byte> mine) {
  std::vector<unsigned char> lengths(static_cast<size_t>(c.size) * kLengthBytes);
  gather_exact(c, peers, lengths.data(), kLengthBytes, "all_gather");
  check_lengths(c, lengths, mine.size());
  for (int r = 1; r < c.size; ++r)
    if (const int rc = send_frame(peers[r], kStatusOk, {}, c.deadline); rc != 0) throw_io(c, rc, "all_gather", r);
  std::vector<std::byte> all(static_cast<size_t>(c.size) * mine.size());
  std::copy(mine.begin(), mine.end(), all.begin());
  gather_exact(c, peers, reinterpret_cast<unsigned char*>(all.data()), mine.size(), "all_gather");
  return all;
}

void root_broadcast(const Ctx& c, const std::vector<int>& peers, std::span<const std::byte> all) {
  for (int r = 1; r < c.size; ++r)
    if (const int rc = send_frame(peers[r], kStatusOk, all, c.deadline); rc != 0) throw_io(c, rc, "all_gather", r);
}

std::vector<std::byte> peer_exchange(const Ctx& c, int fd, std::span<const std::byte> mine) {
  unsigned char length[kLengthBytes];
  put_be<uint64_t>(length, mine.size());
  if (const int rc = write_exact(fd, length, sizeof length, c.deadline); rc != 0) throw_io(c, rc, "all_gather", 0);
  read_frame(c, fd, "all_gather", 0);
  if (const int rc = write_exact(fd, mine.data(), mine.size(), c.deadline); rc != 0) throw_io(c, rc, "all_gather", 0);
  std::vector<std::byte> all(static_cast<size_t>(c.size) * mine.size());
  read_frame(c, fd, "all_gather", all.size());
  if (const int rc = read_exact(fd, all.data(), all.size(), c.deadline); rc != 0) throw_io(c, rc, "all_gather", 0);
  return all;
}

// After a failure the stream position is unknown, so every socket is closed
// and the bootstrap stays unusable. With `notify`, the root first tells the
// peers why, so they fail with its reason instead of a closed socket.
template <class Step>
void run_step(int rank, int& listen_fd, std::vector<int>& peers, bool notify, Step&& step) {
  try {
    step();
  } catch (const Error& e) {
    if (rank == 0 && notify)
      for (int fd : peers)
        if (fd >= 0) send_abort(fd, e);
    close_all(listen_fd, peers);
    throw;
  } catch (...) {
    close_all(listen_fd, peers);
    throw;
  }
}

void validate(int rank, int size, const std::string& root_host, uint16_t port, milliseconds timeout) {
  const std::string me = "TcpBootstrap: ";
  if (size < 1) throw InvalidArgument(me + "size must be >= 1, got " + std::to_string(size));
  if (rank < 0 || rank >= size)
    throw InvalidArgument(me + "rank must be in [0, size) = [0, " + std::to_string(size) + "), got " +
                          std::to_string(rank));
  if (port == 0) throw InvalidArgument(me + "port must be in [1, 65535], got 0 (every rank must know it)");
  if (root_host.empty()) throw InvalidArgument(me + "root_host is empty");
  if (timeout.count() <= 0)
    throw InvalidArgument(me + "timeout must be positive, got " + std::to_string(timeout.count()) + " ms");
}

}  // namespace

TcpBootstrap::TcpBootstrap(int rank, int size, const std::string& root_host, uint16_t port,
                           std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_(timeout) {
  validate(rank, size, root_host, port, timeout);
  if (size == 1) return;
  const Ctx c{rank, size, timeout, deadline_after(timeout)};
  const sockaddr_in root = resolve(rank, root_host, port);
  run_step(rank_, listen_fd_, peer_fds_, true, [&] {
    if (rank == 0)
      accept_peers(c, root, listen_fd_, peer_fds_);
    else
      join_root(c, root, peer_fds_);
  });
}

TcpBootstrap::~TcpBootstrap() {
  close_all(listen_fd_, peer_fds_);
}

std::vector<std::byte> TcpBootstrap::all_gather(std::span<const std::byte> mine) {
  if (size_ == 1) return {mine.begin(), mine.end()};
  if (peer_fds_.empty()) throw Error(who(rank_) + "unusable after an earlier failure; create a new TcpBootstrap");
  const Ctx c{rank_, size_, timeout_, deadline_after(timeout_)};
  std::vector<std::byte> all;
  if (rank_ != 0) {
    run_step(rank_, listen_fd_, peer_fds_, false, [&] { all = peer_exchange(c, peer_fds_[0], mine); });
    return all;
  }
  run_step(rank_, listen_fd_, peer_fds_, true, [&] { all = root_collect(c, peer_fds_, mine); });
  // Peers may be part-way through a frame now: a failure reaches them only as
  // a closed socket.
  run_step(rank_, listen_fd_, peer_fds_, false, [&] { root_broadcast(c, peer_fds_, all); });
  return all;
}

}  // namespace turnout
