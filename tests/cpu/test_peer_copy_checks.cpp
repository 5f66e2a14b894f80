// The peer copies' shape check: words in flight and warps a block, with the
// loads' sixteen words only where their registers allow (at most 16 warps).
#include <gtest/gtest.h>

#include <string>

#include "ops/peer_copy.hpp"
#include "turnout/error.hpp"

namespace {

using turnout::InvalidArgument;
using turnout::peer_copy::check_sm_copy;

std::string error_of(int warps, int words, bool sixteen_words) {
  try {
    check_sm_copy("load_from_peers", warps, words, sixteen_words);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(PeerCopyChecks, EveryValidShapePasses) {
  for (int warps : {1, 16, 32})
    for (int words : {1, 2, 4, 8}) {
      EXPECT_EQ(error_of(warps, words, false), "") << warps << " warps, " << words << " words";
      EXPECT_EQ(error_of(warps, words, true), "") << warps << " warps, " << words << " words";
    }
  for (int warps : {1, 5, 16}) EXPECT_EQ(error_of(warps, 16, true), "") << warps << " warps, 16 words";
}

TEST(PeerCopyChecks, BadShapesNameTheArgument) {
  const struct {
    int warps, words;
    bool sixteen;
    const char* argument;
  } bad[] = {{0, 1, true, "warps_per_block"},   {33, 1, true, "warps_per_block"},   {16, 3, true, "words_in_flight"},
             {16, 32, true, "words_in_flight"}, {16, 16, false, "words_in_flight"}, {17, 16, true, "warps_per_block"},
             {32, 16, true, "warps_per_block"}};
  for (const auto& b : bad) {
    const std::string what = error_of(b.warps, b.words, b.sixteen);
    EXPECT_EQ(what.rfind("load_from_peers:", 0), 0u) << what;
    EXPECT_NE(what.find(b.argument), std::string::npos) << b.warps << " warps, " << b.words << " words: " << what;
  }
}

}  // namespace
